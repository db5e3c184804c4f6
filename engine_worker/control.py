"""The worker's side of the control stream: broadcast commands, and the aborted set.

``{ns}:control`` is read with plain XREAD from the position the worker had when it started, so
every worker sees every command once; ``{ns}:handbacks`` in the same read: another worker's note
that it handed entries back (a notice) starts a reclaim pass at once. Aborts are also kept in
``{ns}:aborted``, loaded at start, so a queued request aborted before this worker existed is
still skipped.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

from redis.asyncio import Redis

from redroll.ops.control import ABORTED_RETENTION_S, aborted_member
from redroll.shared.commands import ENGINE_COMMANDS, SYNC_COMMANDS, Abort, Command, Drain, parse_command
from redroll.shared.keys import Keys
from redroll.shared.streams import text
from redroll.shared.types import GenerationRequest

log = logging.getLogger("redroll.worker")


class AbortedSet:
    """The worker's copy of ``{ns}:aborted`` (``r:<id>``, ``g:<group>`` → when): loaded at start,
    then kept current from the control stream, so checking a request costs no round trip. An
    abort that lands after the check finds the request in flight and stops it in the engine, so
    the outcome is the same."""

    def __init__(self) -> None:
        self._members: dict[str, float] = {}

    def __contains__(self, request: GenerationRequest) -> bool:
        members = self._members
        if not members:
            return False
        if aborted_member(request_id=request.request_id) in members:
            return True
        return request.group_id is not None and aborted_member(group_id=request.group_id) in members

    async def load(self, r: Redis, keys: Keys) -> None:
        since = time.time() - ABORTED_RETENTION_S
        for member, score in await r.zrangebyscore(keys.aborted, since, "+inf", withscores=True):
            self._members[text(member)] = float(score)

    def remember(self, cmd: Abort) -> None:
        for rid in cmd.request_ids:
            self._members[aborted_member(request_id=rid)] = cmd.sent_at
        for gid in cmd.group_ids:
            self._members[aborted_member(group_id=gid)] = cmd.sent_at
        if len(self._members) > 10_000 and len(self._members) % 1000 == 0:
            cutoff = time.time() - ABORTED_RETENTION_S
            self._members = {m: t for m, t in self._members.items() if t >= cutoff}


class ControlTarget(Protocol):
    """What the commands act on (the worker)."""

    def abort_matching(self, request_ids: set[str], group_ids: set[str]) -> None: ...

    def request_stop(self) -> None: ...

    def run_engine_command(self, cmd: Command) -> None: ...

    def run_sync_command(self, cmd: Command) -> None: ...

    def reclaim_now(self) -> None: ...


@dataclass(eq=False)
class ControlListener:
    """One worker's reader of the control stream and the hand-back notes."""

    redis: Redis
    keys: Keys
    name: str
    """The worker's name (a command's ``target``)."""
    target: ControlTarget
    """What runs the commands (the worker)."""
    aborted: AbortedSet
    block_ms: int
    """How long one read waits."""
    last_id: str = "0-0"
    """The last command read."""
    last_handback: str = "0-0"
    """The last hand-back note read."""

    async def start(self) -> None:
        """Fix the read positions at the newest command and hand-back note, then load the aborted
        set (in this order: no abort falls between the two)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xrevrange(self.keys.control, count=1)
            pipe.xrevrange(self.keys.handbacks, count=1)
            last, handback = await pipe.execute()
        self.last_id = text(last[0][0]) if last else "0-0"
        self.last_handback = text(handback[0][0]) if handback else "0-0"
        await self.aborted.load(self.redis, self.keys)

    async def run(self, stopping) -> None:  # type: ignore[no-untyped-def]
        # (one blocking read of both: commands, and other workers' hand-back notes)
        while not stopping.is_set():
            resp = await self.redis.xread({self.keys.control: self.last_id, self.keys.handbacks: self.last_handback},
                                          count=100, block=self.block_ms)
            for stream, entries in resp or []:
                if text(stream) == self.keys.handbacks:
                    self.last_handback = text(entries[-1][0])
                    if any(text(f.get(b"worker", b"")) != self.name for _, f in entries):
                        self.target.reclaim_now()
                    continue
                for entry_id, fields in entries:
                    self.last_id = text(entry_id)
                    cmd = parse_command(fields)
                    if cmd is not None:
                        self.apply(cmd)

    def apply(self, cmd: Command) -> None:
        if cmd.target not in (None, "*", self.name):
            return
        if isinstance(cmd, Abort):
            self.aborted.remember(cmd)
            self.target.abort_matching(set(cmd.request_ids), set(cmd.group_ids))
        elif isinstance(cmd, Drain):
            log.info("drain requested through the control stream")
            self.target.request_stop()
        elif isinstance(cmd, ENGINE_COMMANDS):
            self.target.run_engine_command(cmd)
        elif isinstance(cmd, SYNC_COMMANDS):
            self.target.run_sync_command(cmd)

