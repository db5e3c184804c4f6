"""The worker's side of a trainer's weight push (see :mod:`redroll.producer.weight_sync`).

A :class:`SyncWeights` command names the workers of one attempt and their ranks. Each named worker
joins the weight-update group, receives the tensors in order into staging, reports ``received``
in the push's progress hash (``{ns}:wsync:<sync_id>``) and waits for the trainer: on
:class:`SyncCommit` it swaps them in (serving the new version from then on), on
:class:`SyncAbort` — or when the trainer is not heard from within the push's timeout — it drops
them. The collectives run off the event loop, so leases and heartbeats go on meanwhile. An engine
that receives straight into its live weights (SGLang) pauses generation for the push, and when a
push fails there it claims nothing until a later push succeeds.
"""

from __future__ import annotations

import asyncio
import logging

from redroll.engine_worker.context import WorkerContext
from redroll.engine_worker.flights import Flights
from redroll.engine_worker.weights import WeightsGate
from redroll.shared.commands import Command, SyncAbort, SyncCommit, SyncWeights

log = logging.getLogger("redroll.worker")

STALE_WEIGHTS = "stale weights"
"""The claiming hold after a push failed inside an engine that received into its live weights."""

PROGRESS_TTL_S = 3600


class SyncReceiver:
    def __init__(self, ctx: WorkerContext, flights: Flights, gate: WeightsGate):
        self.ctx = ctx
        self.flights = flights
        self.gate = gate
        self._outcomes: dict[tuple[str, int], Command] = {}
        """(sync_id, attempt) → its commit or abort, as soon as it is read."""
        self._changed = asyncio.Event()

    def note(self, cmd: Command) -> None:
        """A commit or an abort from the control stream (it may come before the worker waits)."""
        if isinstance(cmd, (SyncCommit, SyncAbort)):
            self._outcomes[(cmd.sync_id, cmd.attempt)] = cmd
            if len(self._outcomes) > 256:
                self._outcomes.pop(next(iter(self._outcomes)))
            self._changed.set()

    async def _report(self, cmd: SyncWeights, status: str) -> None:
        key = self.ctx.keys.weight_sync(cmd.sync_id)
        async with self.ctx.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, f"{self.ctx.name}:{cmd.attempt}", status)
            pipe.expire(key, PROGRESS_TTL_S)
            await pipe.execute()

    async def _outcome(self, cmd: SyncWeights) -> Command | None:
        deadline = asyncio.get_running_loop().time() + cmd.timeout_s
        while (cmd.sync_id, cmd.attempt) not in self._outcomes:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0 or self.ctx.stopping.is_set():
                return None
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
            except asyncio.TimeoutError:
                pass
        return self._outcomes.pop((cmd.sync_id, cmd.attempt))

    async def run(self, cmd: SyncWeights) -> None:
        """One attempt of a push, if this worker is in it."""
        rank = cmd.ranks.get(self.ctx.name)
        if rank is None:
            return
        engine = self.ctx.engine
        if not self.ctx.capabilities.weights_from_push:
            await self._report(cmd, f"failed: the {engine.info.name} engine cannot take pushed weights (its "
                                    "capabilities do not declare weights_from_push)")
            return
        async with self.gate.lock:
            hold = cmd.mode != "in_place"
            if hold:
                await self.gate.quiesce("weights", abort_inflight=cmd.mode == "abort")
            try:
                await self._receive(cmd, rank)
            finally:
                await engine.leave_weight_group()
                if hold:
                    self.flights.release("weights")

    async def _receive(self, cmd: SyncWeights, rank: int) -> None:
        engine = self.ctx.engine
        try:
            await self._report(cmd, "joining")
            await engine.join_weight_group(address=cmd.master_address, port=cmd.master_port, rank_offset=rank,
                                           world_size=cmd.world_size, group_name=cmd.group_name,
                                           backend=cmd.backend, timeout_s=cmd.timeout_s)
            await self._report(cmd, "joined")
            await engine.receive_weights(cmd.tensors, group_name=cmd.group_name, version=cmd.version,
                                         in_place=cmd.mode == "in_place")
            await self._report(cmd, "received")
        except Exception as exc:
            log.warning("push %s (attempt %d) failed here: %s: %s", cmd.sync_id, cmd.attempt, type(exc).__name__, exc)
            await self._discard(cmd)
            await self._report(cmd, f"failed: {type(exc).__name__}: {exc}"[:300])
            return
        outcome = await self._outcome(cmd)
        if not isinstance(outcome, SyncCommit):
            log.warning("push %s (attempt %d) %s: its weights are dropped", cmd.sync_id, cmd.attempt,
                        "aborted by the trainer" if outcome is not None else "not committed in time")
            await self._discard(cmd)
            await self._report(cmd, "discarded")
            return
        try:
            await engine.commit_weights(cmd.version)
        except Exception as exc:
            # Neither the old weights nor the new for sure: nothing is claimed until a push
            # succeeds, and the trainer hears of it now (it waited for "committed" until its timeout).
            log.error("push %s (attempt %d): the commit failed here (%s: %s): claiming nothing until a push "
                      "succeeds", cmd.sync_id, cmd.attempt, type(exc).__name__, exc)
            self.flights.hold(STALE_WEIGHTS)
            await self._report(cmd, f"failed: commit: {type(exc).__name__}: {exc}"[:300])
            return
        self.flights.release(STALE_WEIGHTS)
        self.gate.weights_changed(f"push:{cmd.version}")
        await self._report(cmd, "committed")
        await self.gate._heartbeat()

    async def _discard(self, cmd: SyncWeights) -> None:
        if not await self.ctx.engine.discard_weights():
            # The engine received into its live weights: they are neither the old nor the new ones.
            log.error("push %s failed after this engine took part of it: claiming nothing until a push succeeds",
                      cmd.sync_id)
            self.flights.hold(STALE_WEIGHTS)
