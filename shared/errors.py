"""The root of every error redroll raises on purpose, and the errors of reaching Redis.

Each error of the family is defined where it is raised; :mod:`redroll.errors` lists them all and
``redroll.<Name>`` exports each.
"""

from __future__ import annotations


class RedrollError(Exception):
    """The root of every error redroll raises on purpose."""


class ConnectionUnavailableError(RedrollError, ConnectionError):
    """Redis cannot be reached: the one-line message names the (redacted) URL; ``__cause__`` is the
    error of the Redis client."""


class RedisConfigError(RedrollError, RuntimeError):
    """The Redis settings cannot work (bad URL, unreadable password file, ...)."""
