"""Write a request entry by hand, as a producer's submit would: the entry and its ownership note
in one server-side call (a worker reading the entry before the note is refused the reply stream)."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from redroll.shared.keys import submitted_as

_XADD_AND_NOTE = """
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
if ARGV[1] ~= '' then redis.call('HSET', KEYS[2], ARGV[1], ARGV[2] .. id) end
return id
"""


async def add_request_entry(r: Redis, stream: str, fields: dict[str, Any], *, owner_key: str | None = None,
                            rid: str | None = None) -> str:
    """XADD ``fields`` to ``stream``; with ``owner_key`` and ``rid``, note the entry there as the
    submit does, in the same call. Returns the entry id."""
    flat = [part for key, value in fields.items() for part in (key, value)]
    noted = rid if owner_key is not None and rid is not None else ""
    entry_id = await r.eval(_XADD_AND_NOTE, 2, stream, owner_key or stream, noted, submitted_as(stream, ""), *flat)
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id
