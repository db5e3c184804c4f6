"""The engine worker: its lifecycle, and the loops it supervises.

One asyncio task per claimed request, at most ``max_inflight`` generating at once, so the engine
sees enough concurrent work to batch (an engine that makes its output at once, ``instant``, has
each claim's entries run in one task instead). The parts, one concern each:

* :mod:`.flights` — the in-flight entries (the only owner of that state) and when tasks start;
* :mod:`.claim` — claiming new entries and reclaiming idle ones from dead workers;
* :mod:`.request` — one request top to bottom: decode, checks, engine, record, finish;
* :mod:`.outcomes` — the fenced finish, dead letters, hand-backs;
* :mod:`.control` — broadcast commands and the aborted set;
* :mod:`.weights` — weight updates, engine memory, requests waiting for new weights;
* :mod:`.liveness` — leases and the heartbeat; :mod:`.housekeeping` — periodic GC.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Sequence

import redis
from redis.asyncio import Redis

from redroll.engine_worker.blocking import FALLBACK_BLOCK_MS, IDLE_BLOCK_MS
from redroll.engine_worker.claim import Claimer, claim_limit, default_max_inflight, engine_capacity
from redroll.engine_worker.context import WorkerContext, WorkerStats
from redroll.engine_worker.control import AbortedSet, ControlListener
from redroll.engine_worker.engines.base import Engine
from redroll.engine_worker.engines.declaration import capabilities_of
from redroll.engine_worker.flights import Flights, InFlight
from redroll.engine_worker.housekeeping import housekeeping_loop
from redroll.engine_worker.lanes import LaneClaimer, LaneTable
from redroll.engine_worker.liveness import Liveness, heartbeat_interval_s
from redroll.engine_worker.notice import plan_notice
from redroll.engine_worker.outcomes import PUBLISH_HOLD, Outcomes, notice_note
from redroll.engine_worker.request import RequestRunner
from redroll.engine_worker.weight_sync import STALE_WEIGHTS, SyncReceiver
from redroll.engine_worker.weights import AWAITING_PUSH, PAUSED, WeightsGate
from redroll.ops.backlog import requests_left
from redroll.shared.commands import Command, SyncWeights
from redroll.shared.connection import connect, open_connections, reach, read_groups
from redroll.shared.keys import HANDBACKS_MAXLEN, WORKERS_GROUP, Keys
from redroll.shared.lanes import agree_on_lanes
from redroll.shared.settings import Settings
from redroll.shared.streams import ensure_groups, run_resilient, unique_consumer_name

log = logging.getLogger("redroll.worker")

WORKER_CONNECTIONS = 6
"""Connections a worker opens at start: what its loops use at once (a claim read, the publisher's
flush, the control stream's blocking read, leases, reclaim passes, dead letters)."""

__all__ = ["InFlight", "Worker", "WorkerStats"]


def _describe_task(task: asyncio.Task) -> str:
    frames = task.get_stack(limit=3)
    where = " < ".join(f"{f.f_code.co_name}:{f.f_lineno}" for f in frames) or "?"
    return f"{task.get_name()} at {where}"


class Worker:
    """Consumes ``{ns}:requests`` through group ``workers`` and publishes one record per request."""

    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        *,
        redis_client: Redis | None = None,
        max_inflight: int | None = None,
        name: str | None = None,
        block_ms: int | None = None,
        reclaim_interval_s: float | None = None,
        only_partitions: Sequence[int] | None = None,
        burst: bool = False,
    ):
        self.settings = settings
        self.keys: Keys = settings.keys
        parts = settings.partition_keys
        if only_partitions is not None:
            wrong = sorted({i for i in only_partitions if not 0 <= i < len(parts)})
            if wrong or not only_partitions:
                raise ValueError(f"only_partitions {list(only_partitions)} must name partitions among "
                                 f"0..{len(parts) - 1} (the pipeline has {len(parts)})")
            parts = [parts[i] for i in sorted(set(only_partitions))]
        self.parts: list[Keys] = parts
        """Per-request keys of the partitions this worker serves, one set per partition (just
        ``[self.keys]`` with one partition); all of them unless ``only_partitions`` names some
        (then other workers must cover the rest: nobody else claims or reclaims them)."""
        self.engine = engine
        self.name = name or unique_consumer_name("worker")
        self.block_ms = block_ms if block_ms is not None else FALLBACK_BLOCK_MS
        """How often loops that poll look again (a burst worker's idle check); also how long the
        claim loops' blocking reads wait when given (default: :data:`~.blocking.IDLE_BLOCK_MS`, cut
        short by a stop or a change of lanes; see :mod:`.blocking`)."""
        self._claim_block_ms = block_ms
        self.reclaim_interval_s = reclaim_interval_s or max(0.05, min(settings.claim_idle_ms / 2000.0, 5.0))
        self.burst = burst
        """Stop (drain and deregister) once this worker holds nothing and the request streams of its
        partitions hold no entry: nothing queued, nothing claimed by any worker (see
        :mod:`redroll.ops.backlog`). Entries a dead worker held are reclaimed first."""
        self.stats = WorkerStats()
        self.metrics: Any = None
        """A :class:`redroll.observability.metrics.WorkerMetrics` when metrics are served."""
        self._redis = redis_client
        self._owns_redis = redis_client is None
        self._stopping = asyncio.Event()
        self._stopped = asyncio.Event()
        self.started = asyncio.Event()
        """Set once the engine runs and the worker claims (whoever owns the process's signal handlers
        installs them after this: an engine may replace them while it starts)."""
        self.capabilities = capabilities_of(engine)
        """What the engine declares beyond the Engine protocol (its ``capabilities``; none without)."""
        # An engine that makes an output at once (the synthetic one without per-token time) runs
        # each claim's entries in one task; any other engine runs a task per request.
        self._max_inflight_given = max_inflight
        """``max_inflight`` as given; None: the engine's capacity plus the claim prefetch, once it started."""
        self.flights = Flights(max_inflight or 1, self._run_request, self._stopping,
                               run_batch=self._run_batch if self.capabilities.instant else None)
        self._requests: RequestRunner | None = None
        self._weights: WeightsGate | None = None
        self._outcomes: Outcomes | None = None
        self._sync: SyncReceiver | None = None
        self.lanes: LaneTable | None = None
        """This worker's view of the affinity lanes (None when they are off)."""
        self._lane_claimer: LaneClaimer | None = None
        self._claimer: Claimer | None = None
        self._control_tasks: set[asyncio.Task] = set()
        self.engine_failure: str | None = None
        """Why the engine died (:class:`~.engines.base.EngineDeadError`), when it did: the worker then
        stopped without a drain and :attr:`exit_status` is 1."""

    @property
    def exit_status(self) -> int:
        """What ``redroll worker`` exits with: 0 after a stop, 1 when the engine died."""
        return 1 if self.engine_failure is not None else 0

    # ------------------------------------------------------------ state

    @property
    def redis(self) -> Redis:
        assert self._redis is not None, "worker not started"
        return self._redis

    @property
    def max_inflight(self) -> int:
        return self.flights.max_inflight

    @property
    def inflight_count(self) -> int:
        """Entries this worker holds (generating, waiting, or being published)."""
        return len(self.flights)

    @property
    def generating_count(self) -> int:
        """Entries holding an engine slot: ``max_inflight`` bounds this."""
        return self.flights.occupied

    def state(self) -> str:
        holds = self.flights.holds
        if self._stopping.is_set():
            return "draining"
        if "memory" in holds:
            return "released"
        if "weights" in holds:
            return "updating"
        if PAUSED in holds:
            return "paused" if self._weights is not None and self._weights.pause_done else "pausing"
        if AWAITING_PUSH in holds or STALE_WEIGHTS in holds:
            return "awaiting_weights"
        if PUBLISH_HOLD in holds:
            return "blocked"
        return "running"

    @property
    def blocked(self) -> dict[str, str]:
        """Streams refusing this worker's writes now → what they answered (see :mod:`.outcomes`)."""
        return self._outcomes.blocked if self._outcomes is not None else {}

    def request_stop(self) -> None:
        """Begin a graceful drain: stop claiming, finish in-flight work up to the drain timeout."""
        self._stopping.set()
        self.flights.wake()
        if self._claimer is not None:  # (their blocking reads end now, not when their time runs out)
            try:
                self._spawn(self._claimer.interrupt())
                if self._lane_claimer is not None:
                    self._spawn(self._lane_claimer.interrupt())
            except RuntimeError:  # (no running event loop: the worker never ran)
                pass

    # ------------------------------------------------------------ wiring (the control target)

    async def _run_request(self, flight: InFlight, fields: dict) -> None:
        assert self._requests is not None
        await self._requests.handle(flight, fields)

    async def _run_batch(self, batch: list[tuple[InFlight, dict]]) -> None:
        assert self._requests is not None
        await self._requests.handle_batch(batch)

    def abort_matching(self, request_ids: set[str], group_ids: set[str]) -> None:
        assert self._requests is not None
        self._requests.abort_matching(request_ids, group_ids)

    def run_engine_command(self, cmd: Command) -> None:
        assert self._weights is not None
        self._spawn(self._weights.run_command(cmd))

    def run_sync_command(self, cmd: Command) -> None:
        assert self._sync is not None
        if isinstance(cmd, SyncWeights):
            self._spawn(self._sync.run(cmd))
        else:
            self._sync.note(cmd)

    def reclaim_now(self) -> None:
        """Another worker handed entries back (a notice, a drain): take what fits here now."""
        if self._claimer is not None:
            self._claimer.wake()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._control_tasks.add(task)
        task.add_done_callback(self._control_tasks.discard)

    def _wire(self) -> tuple[WorkerContext, Claimer, ControlListener, Liveness, Outcomes]:
        ctx = WorkerContext(settings=self.settings, name=self.name, engine=self.engine, redis=self.redis,
                            parts=self.parts, stats=self.stats, stopping=self._stopping, block_ms=self.block_ms,
                            metrics=self.metrics)
        self.lanes = (LaneTable(ctx, interval_s=heartbeat_interval_s(self.settings))
                      if self.settings.affinity_lanes else None)
        liveness = Liveness(ctx, self.flights, state=self.state, blocked=lambda: self.blocked,
                            weights_source=lambda: self._weights.source if self._weights else "initial",
                            lanes=self.lanes, claim_healthy=self._claim_healthy)
        self._outcomes = outcomes = Outcomes(ctx, self.flights)
        aborted = AbortedSet()
        self._weights = WeightsGate(ctx, self.flights, heartbeat=liveness.heartbeat)
        self._sync = SyncReceiver(ctx, self.flights, self._weights)
        self._requests = RequestRunner(ctx, self.flights, outcomes, self._weights, aborted)
        # (the control stream's read is cancelled when the worker stops: it may wait long)
        control = ControlListener(self.redis, self.keys, self.name, self, aborted,
                                  self._claim_block_ms if self._claim_block_ms is not None else IDLE_BLOCK_MS)
        self._claimer = claimer = Claimer(ctx, self.flights, reclaim_interval_s=self.reclaim_interval_s,
                                          reclaim_streams=self.lanes.reclaim_streams if self.lanes is not None else None,
                                          block_ms=self._claim_block_ms)
        if self.lanes is not None:
            self._lane_claimer = LaneClaimer(ctx, self.flights, self.lanes, claimer._give_back,
                                             block_ms=self._claim_block_ms)
        return ctx, claimer, control, liveness, outcomes

    def _claim_healthy(self) -> bool:
        """Whether the claim loops turn (with affinity lanes: see :meth:`.lanes.LaneClaimer.healthy`)."""
        return self._lane_claimer.healthy() if self._lane_claimer is not None else True

    # ------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Run until :meth:`request_stop`, then drain and deregister."""
        if self._redis is None:
            self._redis = connect(self.settings)
        ctx, claimer, control, liveness, outcomes = self._wire()
        await reach(self.redis, self.settings)
        await ctx.scripts.load_all()
        await agree_on_lanes(self.redis, self.keys, self.settings.affinity_lanes)
        await self.engine.start()
        # Fair claiming: what the engine can start at once plus the prefetch (known once started).
        capacity = self.flights.capacity = engine_capacity(self.engine)
        prefetch = self.settings.claim_prefetch
        if self._max_inflight_given is None:
            self.flights.max_inflight = default_max_inflight(capacity, prefetch)
        self.flights.claim_limit = claim_limit(capacity, self.max_inflight, prefetch)
        await self._ensure_groups(ctx)
        await open_connections(self.redis, WORKER_CONNECTIONS)
        await control.start()
        assert self._weights is not None
        await self._weights.load_desired()
        await liveness.heartbeat()
        log.info("worker %s started: engine=%s model=%s capacity=%s max_inflight=%d claim_limit=%d", self.name,
                 self.engine.info.name, self.engine.info.model, capacity, self.max_inflight, self.flights.claim_limit)
        self.started.set()
        groups = read_groups(self.redis, self.parts)  # one claim loop per group
        loops = [
            *(asyncio.create_task(self._guard(ctx, (self._lane_claimer or claimer).loop_for(g, len(groups))),
                                  name=f"claim-{i}")
              for i, g in enumerate(groups)),
            asyncio.create_task(self._guard(ctx, claimer.reclaim_loop), name="reclaim"),
        ]

        async def control_loop() -> None:
            await control.run(self._stopping)

        async def gc_loop() -> None:
            await housekeeping_loop(ctx)

        background = [
            asyncio.create_task(self._guard(ctx, control_loop), name="control"),
            asyncio.create_task(self._guard(ctx, liveness.run), name="lease"),
            asyncio.create_task(self._guard(ctx, gc_loop), name="gc"),
        ]
        if self.burst:
            async def burst_loop() -> None:
                await self._stop_when_idle(ctx)

            background.append(asyncio.create_task(self._guard(ctx, burst_loop), name="burst"))
        try:
            await self._stopping.wait()
            self.engine_failure = ctx.engine_failure
            limit = self.notice_s + 10
            try:
                await asyncio.wait_for(self._shutdown(loops, outcomes), limit)
            except asyncio.TimeoutError:
                # Bounded whatever happens: what is still held is reclaimed by the fleet.
                stuck = [t for t in asyncio.all_tasks() if not t.done() and t is not asyncio.current_task()]
                log.error("worker %s: shutdown did not finish in %.0fs; still running: %s", self.name, limit,
                          "; ".join(_describe_task(t) for t in stuck[:20]))
                for f in self.flights:  # (closing the engine aborts them: nothing of theirs is published)
                    f.handed_back = True
        finally:
            liveness.stop()
            tasks = [*background, *loops, *self._control_tasks]
            for t in tasks:
                t.cancel()
            _, stuck = await asyncio.wait(tasks, timeout=10)
            if stuck:  # (never seen since the lease loop stops on its own; said loudly if it happens)
                log.error("worker %s: tasks still running after cancel: %s", self.name,
                          "; ".join(_describe_task(t) for t in stuck))
            try:
                if self.lanes is not None:  # (out of the lane table too: its lanes move at once)
                    await self.lanes.leave()
                else:
                    await self.redis.hdel(self.keys.workers, self.name)
            except redis.RedisError as exc:
                log.warning("could not deregister heartbeat: %s", exc)
            for reader in [*claimer.readers, *(self._lane_claimer.readers if self._lane_claimer else [])]:
                await reader.close()
            await self.engine.close()
            if self._requests is not None:
                await self._requests.checkpoints.close()
            await ctx.close()
            if self._owns_redis:
                await self.redis.aclose()
            self._stopped.set()
            log.info("worker %s stopped: %s", self.name, self.stats)

    async def _stop_when_idle(self, ctx: WorkerContext) -> None:
        """Burst mode: request a stop once the request streams of this worker's partitions hold no
        entry (nothing queued, nothing claimed by any worker: see :mod:`redroll.ops.backlog`)
        and this worker holds nothing."""
        interval = min(max(self.block_ms / 1000.0, 0.05), 1.0)
        while not self._stopping.is_set():
            if not len(self.flights):
                left = await requests_left(self.redis, self.parts)
                if not left and not len(self.flights):
                    log.info("worker %s (burst): nothing queued or in flight; stopping", self.name)
                    self.request_stop()
                    return
            await ctx.pause(interval)

    async def _shutdown(self, loops: list[asyncio.Task], outcomes: Outcomes) -> None:
        # The notice's hand-over does not wait for the claim loops' blocking reads to return (what
        # those bring after the stop goes straight back: see Claimer).
        drain = asyncio.create_task(self._drain(outcomes))
        await asyncio.gather(*loops, return_exceptions=True)
        await drain

    async def _guard(self, ctx: WorkerContext, loop_fn: Any) -> None:
        """Run a loop; on Redis errors back off and resume, so an outage never kills the worker."""
        async def recreate() -> None:
            await self._ensure_groups(ctx, again=True)

        await run_resilient(loop_fn, stopping=self._stopping, recreate_groups=recreate, log=log)

    async def _ensure_groups(self, ctx: WorkerContext, *, again: bool = False) -> None:
        """Group ``workers`` on the request streams this worker reads, in one round trip. With
        affinity lanes, a lane's group is made by its owner when it gets the lane (see
        :meth:`.lanes.LaneTable.beat`): here only the high-priority and shared streams, and the
        lanes it owns now (``again``: a read met NOGROUP, a stream was deleted). Every worker
        making every lane's group at its start made four million calls for a thousand workers over
        four thousand lanes."""
        streams = ctx.request_streams
        if self.lanes is not None:
            owned = {s for part in self.parts for s in (part.lane(j) for j in self.lanes.owned)} if again else set()
            lanes = {s for part in self.parts for s in part.lane_streams}
            streams = [s for s in streams if s not in lanes or s in owned]
        await ensure_groups(self.redis, streams, WORKERS_GROUP)

    @property
    def notice_s(self) -> float:
        """How long a stop (SIGTERM, a drain) leaves this worker: ``notice_s``, at most ``drain_timeout_s``."""
        return min(self.settings.notice_s, self.settings.drain_timeout_s)

    async def _drain(self, outcomes: Outcomes) -> None:
        """The notice (:mod:`.notice`): what will finish inside it finishes here, the rest is saved
        and handed back at once; what still runs when it is nearly over is handed back then (all of
        it at once when the engine died: nothing more finishes here)."""
        flights = self.flights
        if not len(flights):
            return
        if self.engine_failure is not None:
            await self._hand_over(list(flights), outcomes, "its engine died")
            return
        loop = asyncio.get_running_loop()
        window = self.notice_s
        ends = loop.time() + window
        assert self._requests is not None
        plan = plan_notice(flights, self.engine, self.capabilities.partial_output, self._requests.rate, window)
        log.info("notice: %d request(s) finish here within %.1fs, %d handed over now", len(plan.finish), window,
                 len(plan.hand_over))
        await self._hand_over(plan.hand_over, outcomes, "notice")
        tasks = [f.task for f in plan.finish if f.task is not None and not f.task.done()]
        if tasks:
            # (the hand-over of what is still running then, its save and the note take a moment too)
            await asyncio.wait(tasks, timeout=max(0.0, ends - loop.time() - min(1.0, window * 0.1)))
        await self._hand_over([f for f in flights if not f.handed_back], outcomes, "notice ran out")

    async def _hand_over(self, flights: list[InFlight], outcomes: Outcomes, why: str) -> None:
        """Abort ``flights``' generations, save what they made (their tasks flush it: one batched
        write), hand the entries back in one call per stream, and tell the fleet so that idle
        workers take them at once."""
        if not flights:
            return
        for f in flights:
            f.handed_back = True
            self.engine.abort(f.handle)
        await asyncio.gather(*(f.task for f in flights if f.task is not None), return_exceptions=True)
        if self.engine_failure is not None:  # (it counts as a delivery: an engine's death may be the request's doing)
            notes: str | list[str] = f"handed back by {self.name} ({why})"
        else:
            notes = [notice_note(self.name, why, f.uncounted_runs + 1) for f in flights]
        handed = await outcomes.hand_back_all(flights, notes)
        log.info("handed back %d request(s) to the fleet (%s)", handed, why)
        if handed:
            try:
                await self.redis.xadd(self.keys.handbacks, {"worker": self.name, "entries": handed},
                                      maxlen=HANDBACKS_MAXLEN, approximate=True)
            except redis.RedisError as exc:  # (they are taken at the fleet's next reclaim pass instead)
                log.warning("could not tell the fleet of %d hand-back(s): %s", handed, exc)
