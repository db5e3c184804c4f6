"""What a consumer group has left to do on some streams: entries not yet delivered, and entries
delivered but not yet acked. A burst worker or consumer stops when this is zero and it holds
nothing; :class:`redroll.testing.Pipeline` asks the same question.

Each call looks at streams that share a hash tag (one partition's streams) in one ``MULTI``: a
read that delivers an entry between two of its answers cannot make the entry look neither
pending nor new.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import redis

from .streams import id_tuple, text


@dataclass(frozen=True)
class Backlog:
    """One group's unfinished entries on some streams."""

    undelivered: int
    """Entries the group has not read yet (a lower bound of one per stream whose lag Redis does
    not know, after deletions)."""
    pending: int
    """Entries read by a consumer of the group and not acked."""

    @property
    def empty(self) -> bool:
        return not self.undelivered and not self.pending


def _field(info: dict, name: str) -> Any:
    for key, value in info.items():
        if text(key) == name:
            return value
    return None


def _undelivered(group_info: dict | None, last_entry: list, length: int) -> int:
    if group_info is None:  # no group yet: every entry is still to be read
        return length
    if not last_entry:
        return 0
    last_id = text(last_entry[0][0])
    delivered = text(_field(group_info, "last-delivered-id") or "0-0")
    if id_tuple(last_id) <= id_tuple(delivered):
        return 0
    lag = _field(group_info, "lag")
    return max(1, int(lag)) if lag is not None else 1


async def group_backlog(r: Any, streams: Sequence[str], group: str) -> Backlog:
    """The backlog of ``group`` over ``streams``, which must share a hash tag (one partition's
    streams, or one stream): they are read in one transaction. A stream that does not exist holds
    nothing."""
    if not streams:
        return Backlog(0, 0)
    async with r.pipeline(transaction=True) as pipe:
        for stream in streams:
            pipe.xinfo_groups(stream)
            pipe.xrevrange(stream, count=1)
            pipe.xlen(stream)
        replies = await pipe.execute(raise_on_error=False)
    undelivered = pending = 0
    for i, stream in enumerate(streams):
        groups, last_entry, length = replies[3 * i: 3 * i + 3]
        if isinstance(groups, redis.ResponseError):
            if "no such key" in str(groups).lower():
                continue
            raise groups
        for reply in (last_entry, length):
            if isinstance(reply, Exception):
                raise reply
        mine = next((g for g in groups if text(_field(g, "name")) == group), None)
        undelivered += _undelivered(mine, last_entry, int(length))
        pending += int(_field(mine, "pending") or 0) if mine is not None else 0
    return Backlog(undelivered, pending)


async def backlog_by_tag(r: Any, stream_sets: Sequence[Sequence[str]], group: str) -> Backlog:
    """:func:`group_backlog` summed over sets of streams, one transaction per set (per partition)."""
    undelivered = pending = 0
    for streams in stream_sets:
        b = await group_backlog(r, streams, group)
        undelivered += b.undelivered
        pending += b.pending
    return Backlog(undelivered, pending)
