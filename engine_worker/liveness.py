"""Leases and the heartbeat: what tells the fleet this worker is alive and what it holds."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections import deque
from typing import Any, Callable

import redis

from redroll.engine_worker.context import WorkerContext
from redroll.engine_worker.flights import Flights
from redroll.shared.keys import WORKERS_GROUP

log = logging.getLogger("redroll.worker")


def heartbeat_interval_s(settings: Any) -> float:
    """Seconds between two heartbeats: ``heartbeat_s``, at most a third of ``claim_idle``."""
    return max(0.05, min(settings.heartbeat_s, settings.claim_idle_ms / 3000.0))


class Liveness:
    def __init__(self, ctx: WorkerContext, flights: Flights, *, state: Callable[[], str],
                 blocked: Callable[[], dict[str, str]], weights_source: Callable[[], str] = lambda: "initial",
                 lanes: Any = None, claim_healthy: Callable[[], bool] = lambda: True):
        self.ctx = ctx
        self.lanes = lanes
        """A :class:`.lanes.LaneTable` with affinity lanes (its heartbeat writes the lane table too)."""
        self._claim_healthy = claim_healthy
        self.flights = flights
        self._state = state
        self._blocked = blocked
        self._weights_source = weights_source
        self._beat_error: str | None = None
        self.started_at = time.time()
        self.interval_s = heartbeat_interval_s(ctx.settings)
        self._rate_samples: deque[tuple[float, int, int]] = deque()
        self._done = asyncio.Event()

    async def run(self) -> None:
        # Runs through the drain too (until :meth:`stop`, once the worker has stopped): work that
        # is still finishing keeps its leases, and the heartbeat says "draining".
        while not self._done.is_set():
            try:
                await asyncio.wait_for(self._done.wait(), self.interval_s)
                return
            except asyncio.TimeoutError:
                pass
            await self.renew_leases()
            await self.heartbeat()

    def stop(self) -> None:
        """End :meth:`run` at its next step (a cancellation alone can be lost: Python 3.11's
        ``asyncio.wait_for`` returns the result when cancelled as its awaitable completes)."""
        self._done.set()

    async def renew_leases(self) -> None:
        """Renew the leases that are a third of ``claim_idle`` old or more (each beat comes within a
        third of it, so none gets older than two thirds): an entry that ends sooner is never
        renewed, and a long one once per third of ``claim_idle``, not at every beat (a fleet
        holding many entries renewed every one of them every beat)."""
        ctx = self.ctx
        now = time.time()
        due = now - ctx.settings.claim_idle_ms / 3000.0
        flights = [f for f in self.flights if not f.handed_back and (f.leased_at or f.claimed_at) <= due]
        if not flights:
            return
        for f in flights:
            f.leased_at = now
        lost: set[str] = set()
        for stream in ctx.request_streams:
            batch = [f for f in flights if f.stream == stream and not f.handed_back]
            if not batch:
                continue
            lost |= {ctx.flight_key(stream, i) for i in await ctx.scripts.renew(stream, WORKERS_GROUP, ctx.name,
                                                                                [f.entry_id for f in batch])}
            # An entry handed back while this renewal was on its way was leased again by it: hand
            # it back once more (owner-checked), or the fleet would wait claim_idle to take it.
            again = [f.entry_id for f in batch if f.handed_back]
            if again:
                await ctx.scripts.renew(stream, WORKERS_GROUP, ctx.name, again, idle_ms=ctx.settings.claim_idle_ms,
                                        marks=ctx.part_of[stream].reclaim_marks)
        for f in flights:
            if f.key in lost and not f.lease_lost and not f.publishing and self.flights.holds_entry(f):
                f.lease_lost = True
                ctx.stats.lease_losses += 1
                log.warning("lease on entry %s lost; stopping its generation", f.entry_id, extra=f.context())
                ctx.engine.abort(f.handle)

    def _rates(self, window_s: float = 60.0) -> dict[str, float]:
        """Requests and tokens per second over the last ``window_s`` (from heartbeat samples)."""
        stats = self.ctx.stats
        now = time.monotonic()
        self._rate_samples.append((now, stats.published, stats.tokens))
        while len(self._rate_samples) > 2 and now - self._rate_samples[1][0] >= window_s:
            self._rate_samples.popleft()
        t0, p0, k0 = self._rate_samples[0]
        span = now - t0
        if span <= 0:
            return {"requests_per_s_1m": 0.0, "tokens_per_s_1m": 0.0}
        return {"requests_per_s_1m": round((stats.published - p0) / span, 3),
                "tokens_per_s_1m": round((stats.tokens - k0) / span, 3)}

    async def heartbeat(self) -> None:
        ctx = self.ctx
        info, stats = ctx.engine.info, ctx.stats
        beat = {
            "host": socket.gethostname(), "pid": os.getpid(), "engine": info.name, "model": info.model,
            "weight_version": info.weight_version, "inflight": len(self.flights),
            "capacity": self.flights.capacity, "max_inflight": self.flights.max_inflight,
            "claim_limit": self.flights.claim_limit, "started": round(self.started_at, 3),
            "seen": round(time.time(), 3), "published": stats.published, "tokens": stats.tokens,
            "fenced": stats.fenced, "lease_losses": stats.lease_losses, "dead_lettered": stats.dead_lettered,
            "state": self._state(), "weights_source": self._weights_source(),
            "weight_ranks": int(getattr(info, "weight_ranks", 1) or 1), **self._rates(),
        }
        if info.max_context is not None:  # (the gateway's /v1/models names it max_model_len)
            beat["max_context"] = info.max_context
        if ctx.capabilities.progress_counters:  # engines that count their decode work (synthetic, transformers)
            beat["tokens_decoded"] = ctx.engine.tokens_decoded
        if ctx.capabilities.prefill_counters:  # engines that count their prefill (the transformers engine)
            beat["prefill_tokens"] = {"computed": ctx.engine.prefill_tokens_computed,
                                      "cached": ctx.engine.prefill_tokens_cached}
        blocked = self._blocked()
        if blocked:
            beat["blocked"] = blocked
        try:
            if self.lanes is not None:
                # (the lanes it owned until now: the call brings the table, and this worker's
                # view of it, up to date)
                beat["lanes"] = self.lanes.owned
                beat["room"] = room = len(self.flights) < self.flights.claim_limit and self._claim_healthy()
                await self.lanes.beat(beat, room)
            else:
                await ctx.redis.hset(ctx.keys.workers, ctx.name, json.dumps(beat, separators=(",", ":")))
        except redis.ResponseError as exc:  # out of memory, a read-only replica: said once, not per beat
            if str(exc) != self._beat_error:
                log.warning("heartbeat refused: %s", exc)
            self._beat_error = str(exc)
        else:
            self._beat_error = None
