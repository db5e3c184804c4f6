"""Small stream helpers shared by workers, producers and consumers."""

from __future__ import annotations

import os
import secrets
import socket
from typing import Any

import redis
from redis.asyncio import Redis


async def ensure_group(r: Redis, stream: str, group: str) -> bool:
    """Create ``group`` on ``stream`` from id 0 (MKSTREAM). Returns False when it already existed."""
    try:
        await r.xgroup_create(stream, group, id="0", mkstream=True)
        return True
    except redis.ResponseError as exc:
        if "BUSYGROUP" in str(exc):
            return False
        raise


def unique_consumer_name(role: str) -> str:
    """host-pid-random: unique per process start and never reused."""
    host = socket.gethostname().replace(" ", "_")[:40]
    return f"{role}-{host}-{os.getpid()}-{secrets.token_hex(3)}"


def text(value: Any) -> str:
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)


def id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
