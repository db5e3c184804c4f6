"""Replicated durability: a write counts as done only once replicas have it.

Redis replicates asynchronously: a primary answers a write before its replicas have it, and a
failover to a replica loses what the replica had not received. With ``wait_replicas`` N > 0 the
writes that acknowledge something to someone (a producer's submit, a worker's finish, a consumer's
ack) are followed by ``WAIT N wait_timeout_ms`` (``WAITAOF 1 N wait_timeout_ms`` with ``wait_aof``)
in the same pipeline, hence on the same connection: WAIT counts the replicas that acknowledged
everything that connection wrote, and it cannot run inside a script or a MULTI (it would not
block there). This module is the one place that adds the WAIT and reads its answer, whatever runs
the write (a script, a function, a MULTI).

Fewer replicas than asked within the timeout raises :class:`ReplicasBehindError`, a connection
error: the write may be on the primary only, so it is not reported done, and each caller takes
the path it takes for a connection lost after the write: it sends the write again, which is
idempotent (a submit with the same token, a finish its finish marker recognises, an ack and its
de-duplication markers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import redis

from redroll.shared.connection.sentinel import leave_demoted_primary
from redroll.shared.errors import RedisConfigError, RedrollError
from redroll.shared.settings import Settings


class ReplicasBehindError(RedrollError, redis.ConnectionError):
    """Fewer replicas than ``wait_replicas`` acknowledged a write within ``wait_timeout_ms``: it
    may not survive a failover, so it is not reported done (its caller sends it again)."""


class _DemotedPrimary(RedrollError, redis.ConnectionError):
    """The wait reached a replica: the connection is to a primary that was demoted."""


@dataclass(frozen=True)
class Durability:
    """What to wait for after a write (nothing when ``replicas`` is 0 and ``aof`` is off)."""

    replicas: int = 0
    timeout_ms: int = 1000
    aof: bool = False

    @classmethod
    def of(cls, settings: Settings) -> "Durability":
        return cls(settings.wait_replicas, settings.wait_timeout_ms, settings.wait_aof)

    @property
    def waits(self) -> bool:
        return self.replicas > 0 or self.aof

    def command(self) -> tuple[Any, ...]:
        if self.aof:
            return ("WAITAOF", 1, self.replicas, self.timeout_ms)
        return ("WAIT", self.replicas, self.timeout_ms)

    def queue(self, pipe: Any) -> None:
        """Add the wait to ``pipe`` after the write(s) queued in it (nothing when off)."""
        if self.waits:
            pipe.execute_command(*self.command())

    async def execute(self, pipe: Any) -> list:
        """Send ``pipe`` (its writes queued, not yet the wait) with the wait last, as
        ``pipe.execute(raise_on_error=False)``; returns the writes' replies (see :meth:`checked`).
        A connection that turns out to reach a replica (a demoted primary) is dropped, with the
        rest of a Sentinel client's pool, so that the retry looks the primary up again."""
        self.queue(pipe)
        replies = await pipe.execute(raise_on_error=False)
        try:
            return self.checked(replies)
        except _DemotedPrimary as exc:
            await leave_demoted_primary(pipe, [str(exc.__cause__)])
            raise

    def checked(self, replies: list) -> list:
        """``replies`` of a pipeline given :meth:`queue` (executed with ``raise_on_error=False``),
        without the wait's. Raises :class:`ReplicasBehindError` when the writes all succeeded but
        too few replicas (or, with ``aof``, not the primary's own append-only file) have them.
        When a write failed its error is left for the caller, which raises it."""
        if not self.waits:
            return replies
        writes, answer = replies[:-1], replies[-1]
        if any(isinstance(reply, Exception) for reply in writes):
            return writes
        if isinstance(answer, Exception):
            raise self._refused(answer)
        if self.aof:
            local, replicas = int(answer[0]), int(answer[1])
            if local < 1 or replicas < self.replicas:
                raise ReplicasBehindError(
                    f"WAITAOF: the write is fsynced on {'the primary and ' if local else ''}{replicas} of "
                    f"{self.replicas} replica(s) after {self.timeout_ms} ms (wait_replicas, wait_timeout_ms); "
                    "sending it again")
            return writes
        if int(answer) < self.replicas:
            raise ReplicasBehindError(
                f"WAIT: {int(answer)} of {self.replicas} replica(s) acknowledged the write within "
                f"{self.timeout_ms} ms (wait_replicas, wait_timeout_ms); sending it again")
        return writes

    async def transaction(self, client: Any, fill: Callable[[Any], None]) -> list:
        """MULTI, the commands ``fill(pipe)`` queues, EXEC, then the wait, in one round trip on one
        connection; returns the EXEC's replies (raises the first error, as a MULTI pipeline does).
        Off, it is a plain MULTI pipeline. (redis-py's MULTI pipeline cannot be followed by
        another command on its connection, so the MULTI is spelled out in a plain pipeline.)"""
        if not self.waits:
            async with client.pipeline(transaction=True) as pipe:
                fill(pipe)
                return await pipe.execute()
        async with client.pipeline(transaction=False) as pipe:
            pipe.execute_command("MULTI")
            fill(pipe)
            pipe.execute_command("EXEC")
            replies = await self.execute(pipe)
        done = replies[-1]
        for reply in replies[:-1]:  # (a command refused while queued: Redis then aborts the EXEC)
            if isinstance(reply, Exception):
                raise reply
        if isinstance(done, Exception):
            raise done
        for reply in done:
            if isinstance(reply, Exception):
                raise reply
        return done

    def _refused(self, error: Exception) -> Exception:
        message = str(error)
        if self.aof and ("unknown command" in message.lower() or "appendonly" in message.lower()):
            return RedisConfigError(
                f"wait_aof (REDROLL_WAIT_AOF) needs WAITAOF on a primary with appendonly yes "
                f"(Redis 7.2+ or Valkey 8): the server answered {message!r}")
        if "replica" in message.lower():  # "WAIT cannot be used with replica instances": a demoted primary
            demoted = _DemotedPrimary(f"the primary was demoted to a replica ({message}); reconnecting")
            demoted.__cause__ = error
            return demoted
        return error

    async def check_server(self, client: Any) -> None:
        """At start: refuse, with one line naming the setting, a ``wait_aof`` the server cannot
        honour (no WAITAOF before Redis 7.2; none without appendonly)."""
        if not self.aof:
            return
        try:
            await client.execute_command("WAITAOF", 1, 0, 1)  # (a new connection wrote nothing: no wait)
        except redis.ResponseError as exc:
            raise self._refused(exc) from None
