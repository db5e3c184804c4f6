"""What is left to do, for burst workers and consumers (they stop when nothing is) and for
:class:`redroll.testing.Pipeline` users.

- **Requests**: a request's entry stays in its request stream until it is finished, dead-lettered
  or cancelled, and is deleted then (in the same script that publishes its record). So the request
  streams of a partition hold nothing, queued or claimed, exactly when their lengths are all zero:
  :func:`requests_left` reads them (``XLEN``, a count, nothing of the requests) in one ``MULTI``
  per partition.
- **Records**: a results stream keeps its records until every group acked them, so what one group
  has left is its ``pending`` count plus its ``lag`` (entries it has not read), from ``XINFO
  GROUPS`` in one ``MULTI`` (:func:`group_backlog`): one instant, so a read that delivers an entry
  meanwhile cannot make it look neither pending nor new. Where Redis cannot tell the lag (a group
  created at the start of a stream already trimmed), the stream counts as not done; the lag is
  known again once the group has read to the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import redis

from redroll.shared.keys import Keys
from redroll.shared.streams import text


@dataclass(frozen=True)
class Backlog:
    """One group's unfinished entries on some streams."""

    undelivered: int
    """Entries the group has not read yet (1 for a stream where Redis cannot tell)."""
    pending: int
    """Entries read by a consumer of the group and not acked."""

    @property
    def empty(self) -> bool:
        return not self.undelivered and not self.pending


async def requests_left(r: Any, parts: Sequence[Keys]) -> int:
    """Requests queued or claimed (by any worker) in the request streams of ``parts``: their
    entries, counted in one transaction per partition."""
    left = 0
    for part in parts:
        async with r.pipeline(transaction=True) as pipe:
            for stream in part.request_streams:
                pipe.xlen(stream)
            left += sum(int(n) for n in await pipe.execute())
    return left


def _field(info: dict, name: str) -> Any:
    for key, value in info.items():
        if text(key) == name:
            return value
    return None


async def group_backlog(r: Any, streams: Sequence[str], group: str) -> Backlog:
    """The backlog of ``group`` on ``streams`` (streams that share a hash tag, whose entries are
    never deleted ahead of the group: results or reply streams). A stream that does not exist holds
    nothing; one without the group counts as not read (1)."""
    if not streams:
        return Backlog(0, 0)
    async with r.pipeline(transaction=True) as pipe:
        for stream in streams:
            pipe.xinfo_groups(stream)
        replies = await pipe.execute(raise_on_error=False)
    undelivered = pending = 0
    for groups in replies:
        if isinstance(groups, redis.ResponseError):
            if "no such key" in str(groups).lower():
                continue
            raise groups
        mine = next((g for g in groups if text(_field(g, "name")) == group), None)
        if mine is None:
            undelivered += 1
            continue
        lag = _field(mine, "lag")
        undelivered += int(lag) if lag is not None else 1
        pending += int(_field(mine, "pending") or 0)
    return Backlog(undelivered, pending)
