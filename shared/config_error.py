"""The error of Redis settings that cannot work (its own module: the connection, Sentinel and
durability modules all raise it)."""

from __future__ import annotations

from redroll.shared.errors import RedrollError


class RedisConfigError(RedrollError, RuntimeError):
    """The Redis settings cannot work (bad URL, unreadable password file, ...)."""
