"""The engine worker loop: claim, lease, generate, finish, abort, drain.

One asyncio task per claimed request, at most ``max_inflight`` at once, so the engine sees
enough concurrent work to batch. Every record is published by the fenced finish script: a
worker that lost its lease (paused, cut off, reclaimed by another) cannot publish.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import redis
from redis.asyncio import Redis

from redroll.shared.batcher import CommandBatcher
from redroll.shared.codec import NewerSchemaError, ValidationError, decode_request
from redroll.shared.connection import connect, read_groups
from redroll.shared.control import ABORTED_RETENTION_S, ControlCommand, aborted_member
from redroll.shared.gc import collect_garbage
from redroll.shared.keys import WORKERS_GROUP, Keys
from redroll.shared.scripts import DeadLetter, Scripts
from redroll.shared.settings import Settings
from redroll.shared.streams import ensure_group, run_resilient, text, unique_consumer_name
from redroll.shared.types import CompletionRecord, GenerationRequest, RecordStatus

from .engines.base import Engine, EngineOutput
from .publisher import Publisher
from .records import build_record

log = logging.getLogger("redroll.worker")


@dataclass
class WorkerStats:
    claimed: int = 0
    reclaimed: int = 0
    published: int = 0
    fenced: int = 0
    lease_losses: int = 0
    dead_lettered: int = 0
    handed_back: int = 0
    engine_errors: int = 0
    tokens: int = 0
    by_status: dict[str, int] = field(default_factory=dict)


@dataclass
class InFlight:
    stream: str
    entry_id: str
    key: str
    """Unique across the request streams: the key of ``_inflight`` and of ``{ns}:errors``."""
    handle: str
    deliveries: int
    claimed_at: float
    request: GenerationRequest | None = None
    task: asyncio.Task | None = None
    stop_status: RecordStatus | None = None
    stop_reason: str | None = None
    """Why it was stopped: "user", "deadline" or "weight_update" (meta_info.abort_reason)."""
    """Set when the worker stops the generation: ABORTED (user abort) or EXPIRED (deadline)."""
    handed_back: bool = False
    lease_lost: bool = False
    released: bool = False
    """Its engine slot was given back (generation over, the record is being published)."""
    publishing: bool = False
    """Its finish or dead letter is under way (a renewal racing it may see the entry as gone)."""
    deadline_timer: asyncio.TimerHandle | None = None


class _AwaitWeights(Exception):
    """Raised inside a request's task to park it until the worker's weights are new enough."""


def _version_number(version: Any) -> int | None:
    """Weight versions are compared as integers ("200" → 200); anything else has no order."""
    try:
        return int(str(version))
    except (TypeError, ValueError):
        return None


def _describe_task(task: asyncio.Task) -> str:
    frames = task.get_stack(limit=3)
    where = " < ".join(f"{f.f_code.co_name}:{f.f_lineno}" for f in frames) or "?"
    return f"{task.get_name()} at {where}"


def _ctx(flight: InFlight) -> dict[str, Any]:
    """Log context: every line about a request names it (the JSON log format emits these fields)."""
    return {"request_id": flight.request.request_id if flight.request else None, "entry_id": flight.entry_id}


class Worker:
    """Consumes ``{ns}:requests`` through group ``workers`` and publishes one record per request."""

    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        *,
        redis_client: Redis | None = None,
        max_inflight: int = 32,
        name: str | None = None,
        block_ms: int = 1000,
        reclaim_interval_s: float | None = None,
        only_partitions: Sequence[int] | None = None,
    ):
        self.settings = settings
        self.keys: Keys = settings.keys
        """Pipeline-wide keys (control, weights, workers, aborted, errors)."""
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
        # Claiming order: every partition's high-priority stream, then every normal one.
        self.request_streams = [k.requests_high for k in self.parts] + [k.requests for k in self.parts]
        self._part_of = {stream: k for k in self.parts for stream in k.request_streams}
        self.engine = engine
        self.max_inflight = max(1, int(max_inflight))
        self.name = name or unique_consumer_name("worker")
        self.block_ms = block_ms
        self.reclaim_interval_s = reclaim_interval_s or max(0.05, min(settings.claim_idle_ms / 2000.0, 5.0))
        self.lease_interval_s = max(0.05, min(settings.heartbeat_s, settings.claim_idle_ms / 3000.0))
        self.stats = WorkerStats()
        self.metrics: Any = None
        """A :class:`redroll.shared.metrics.WorkerMetrics` when metrics are served."""
        self._redis = redis_client
        self._owns_redis = redis_client is None
        self._inflight: dict[str, InFlight] = {}
        self._slot_free = asyncio.Event()
        self._stopping = asyncio.Event()
        self._stopped = asyncio.Event()
        self._started_at = time.time()
        self._isolating = False
        self._released = 0
        """In-flight entries past the engine (being published): they no longer count as occupied."""
        self._aborted: dict[str, float] = {}
        """Members of ``{ns}:aborted`` (``r:<id>``, ``g:<group>``) → when."""
        self._rate_samples: deque[tuple[float, int, int]] = deque()
        self._holds: set[str] = set()
        self._deferred: list[tuple[InFlight, dict]] = []
        self._awaiting_weights: list[tuple[InFlight, dict]] = []
        """Reasons claiming is paused (a weight update, released GPU memory)."""
        self._weights_lock = asyncio.Lock()
        self._control_tasks: set[asyncio.Task] = set()
        self._control_last_id = "0-0"
        self._reply_keys_ok: set[tuple[str, str]] = set()
        """(partition tag, reply_to) pairs already checked to be this pipeline's streams."""

    # ------------------------------------------------------------------ lifecycle

    @property
    def redis(self) -> Redis:
        assert self._redis is not None, "worker not started"
        return self._redis

    @property
    def inflight_count(self) -> int:
        """Entries this worker holds (generating, waiting, or being published)."""
        return len(self._inflight)

    @property
    def generating_count(self) -> int:
        """Entries holding an engine slot: ``max_inflight`` bounds this."""
        return self._occupied

    def request_stop(self) -> None:
        """Begin a graceful drain: stop claiming, finish in-flight work up to the drain timeout."""
        self._stopping.set()
        self._slot_free.set()

    async def run(self) -> None:
        """Run until :meth:`request_stop`, then drain and deregister."""
        if self._redis is None:
            self._redis = connect(self.settings)
        self.scripts = Scripts(self.redis)
        self.batcher = CommandBatcher(self.redis)
        self.publisher = Publisher(self.redis, self.scripts, consumer=self.name, worker=self.name)
        await self.scripts.load_all()
        await self.engine.start()
        await self._ensure_groups()
        last = await self.redis.xrevrange(self.keys.control, count=1)
        self._control_last_id = text(last[0][0]) if last else "0-0"
        await self._load_aborted()  # after fixing the control position: no abort falls between
        await self._load_desired_weights()
        await self._heartbeat()
        log.info("worker %s started: engine=%s model=%s max_inflight=%d", self.name,
                 self.engine.info.name, self.engine.info.model, self.max_inflight)
        groups = read_groups(self.redis, self.parts)  # one claim loop per group
        loops = [
            *(asyncio.create_task(self._guard(self._claim_loop_for(g, len(groups))), name=f"claim-{i}")
              for i, g in enumerate(groups)),
            asyncio.create_task(self._guard(self._reclaim_loop), name="reclaim"),
        ]
        background = [
            asyncio.create_task(self._guard(self._control_loop), name="control"),
            asyncio.create_task(self._guard(self._lease_loop), name="lease"),
            asyncio.create_task(self._guard(self._gc_loop), name="gc"),
        ]
        try:
            await self._stopping.wait()
            try:
                await asyncio.wait_for(self._shutdown(loops), self.settings.drain_timeout_s + 10)
            except asyncio.TimeoutError:
                # Bounded whatever happens: what is still held is reclaimed by the fleet.
                stuck = [t for t in asyncio.all_tasks() if not t.done() and t is not asyncio.current_task()]
                log.error("worker %s: shutdown did not finish in %.0fs; still running: %s", self.name,
                          self.settings.drain_timeout_s + 10, "; ".join(_describe_task(t) for t in stuck[:20]))
        finally:
            for t in background + loops + list(self._control_tasks):
                t.cancel()
            await asyncio.gather(*background, *loops, *self._control_tasks, return_exceptions=True)
            try:
                await self.redis.hdel(self.keys.workers, self.name)
            except redis.RedisError as exc:
                log.warning("could not deregister heartbeat: %s", exc)
            await self.engine.close()
            await self.batcher.close()
            await self.publisher.close()
            if self._owns_redis:
                await self.redis.aclose()
            self._stopped.set()
            log.info("worker %s stopped: %s", self.name, self.stats)

    async def _shutdown(self, loops: list[asyncio.Task]) -> None:
        await asyncio.gather(*loops, return_exceptions=True)
        await self._drain()

    async def _guard(self, loop_fn: Any) -> None:
        """Run a loop; on Redis errors back off and resume, so an outage never kills the worker."""
        await run_resilient(loop_fn, stopping=self._stopping, recreate_groups=self._ensure_groups, log=log)

    async def _ensure_groups(self) -> None:
        for stream in self.request_streams:
            await ensure_group(self.redis, stream, WORKERS_GROUP)

    def _flight_key(self, stream: str, entry_id: str) -> str:
        """Unique over every request stream (the plain normal stream keeps bare entry ids)."""
        return entry_id if stream == self.keys.requests else f"{stream}/{entry_id}"

    async def _pause(self, seconds: float) -> None:
        """Sleep, but wake at once when a stop is requested."""
        try:
            await asyncio.wait_for(self._stopping.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    async def _drain(self) -> None:
        if self._inflight:
            log.info("draining %d in-flight request(s) for up to %.1fs", len(self._inflight),
                     self.settings.drain_timeout_s)
            tasks = [f.task for f in self._inflight.values() if f.task is not None]
            if tasks:  # (entries waiting for a slot, a hold or new weights have no task)
                await asyncio.wait(tasks, timeout=self.settings.drain_timeout_s)
        rest = list(self._inflight.values())
        if rest:
            for f in rest:
                f.handed_back = True
                self.engine.abort(f.handle)
            await asyncio.gather(*(f.task for f in rest if f.task is not None), return_exceptions=True)
            # Mark them as handed back on purpose, so whoever takes them does not treat them as
            # suspects of killing a worker.
            await self.redis.hset(self.keys.errors, mapping={f.key: f"handed back by {self.name} (drain)" for f in rest})
            handed = 0
            for stream in self.request_streams:
                ids = [f.entry_id for f in rest if f.stream == stream]
                lost = await self.scripts.renew(stream, WORKERS_GROUP, self.name, ids,
                                                idle_ms=self.settings.claim_idle_ms)
                handed += len(ids) - len(lost)
            self.stats.handed_back += handed
            log.info("handed back %d request(s) to the fleet", handed)

    # ------------------------------------------------------------------ claiming

    @property
    def _occupied(self) -> int:
        """Entries that hold an engine slot: claimed and not yet through the engine (publishing
        ones have given theirs back, so the next claim overlaps the finish round trip)."""
        return len(self._inflight) - self._released

    async def _wait_for_slot(self) -> None:
        while (self._occupied >= self.max_inflight or self._isolating or self._holds) \
                and not self._stopping.is_set():
            self._slot_free.clear()
            await self._slot_free.wait()

    def _claim_loop_for(self, parts: list[Keys], loops: int) -> Any:
        """The claim loop over ``parts``; with ``loops`` loops at once each reads a share of the
        free slots, so together they take at most about one batch more than there is room for
        (the surplus waits, leased, for a slot)."""
        async def claim_loop() -> None:
            await self._claim_loop(parts, loops)
        return claim_loop

    async def _claim_loop(self, parts: list[Keys], loops: int) -> None:
        highs = {k.requests_high: ">" for k in parts}
        streams = {s: ">" for s in [*highs, *(k.requests for k in parts)]}
        while not self._stopping.is_set():
            await self._wait_for_slot()
            if self._stopping.is_set():
                return
            free = -(-(self.max_inflight - self._occupied) // loops)
            # High priority first, without blocking; then block on every request stream.
            resp = await self.redis.xreadgroup(WORKERS_GROUP, self.name, highs, count=free)
            if not any(entries for _, entries in resp or []):
                resp = await self.redis.xreadgroup(WORKERS_GROUP, self.name, streams, count=free,
                                                   block=self.block_ms)
            resp = sorted(resp or [], key=lambda item: text(item[0]) not in highs)
            running = sum(1 for f in self._inflight.values() if f.task is not None and not f.released)
            for stream, entries in resp:
                for entry_id, fields in entries:
                    self.stats.claimed += 1
                    # A hold or an isolation may have begun while the read was blocked, or both
                    # streams answered: then the entry waits (leased) for its turn.
                    defer = bool(self._holds) or self._isolating or running >= self.max_inflight
                    self._start(text(stream), text(entry_id), fields or {}, deliveries=1, defer=defer)
                    running += not defer

    async def _reclaim_loop(self) -> None:
        """Take over entries idle past ``claim_idle``: dead or paused workers' work, and hand-backs.

        ``XPENDING … IDLE`` first shows what is idle, its owner and delivery count, so the worker
        picks what to take with ``XCLAIM`` (min-idle checked, so two workers never both take one):
        entries with a recorded error or hand-back are taken in bulk; entries that were in flight
        on a worker that died ("suspects": one of them may be what killed it) are taken one at a
        time and run with nothing else in flight. A request that kills every worker it runs on thus
        takes down no innocent neighbour, and only its own delivery count climbs until it is
        dead-lettered; the suspects left for later keep their counts. (XAUTOCLAIM would take and
        count a whole batch at once.) XCLAIM drops ids deleted from the stream from the PEL.
        """
        while not self._stopping.is_set():
            await self._pause(self.reclaim_interval_s)
            try:
                # Isolation lasts until no suspect is left, so new claims do not refill the slots
                # between two suspects.
                while not self._stopping.is_set() and await self._reclaim_once():
                    pass
            finally:
                self._isolating = False
                self._slot_free.set()
                self._start_deferred()

    async def _reclaim_once(self) -> bool:
        """One pass; True when it took a suspect (so the next pass should follow at once)."""
        bulk: list[tuple[str, str, int]] = []
        suspects: list[tuple[str, str, int]] = []
        if self._holds:
            return False
        for stream in self.request_streams:  # high priority first
            # Even with every slot taken, look: suspects are run in isolation, which waits for the
            # slots to empty, so a busy worker still takes over a dead one's work.
            free = max(0, self.max_inflight - self._occupied - len(bulk))
            idle = await self.redis.xpending_range(stream, WORKERS_GROUP, min="-", max="+",
                                                   count=max(free, 16) * 4, idle=self.settings.claim_idle_ms)
            idle = [p for p in idle if self._flight_key(stream, text(p["message_id"])) not in self._inflight]
            if not idle:
                continue
            ids = [text(p["message_id"]) for p in idle]
            notes = await self.redis.hmget(self.keys.errors, [self._flight_key(stream, i) for i in ids])
            for p, entry_id, note in zip(idle, ids, notes):
                deliveries = int(p["times_delivered"]) + 1  # what it will be once claimed
                if note is not None or deliveries > self.settings.max_deliveries:
                    if len(bulk) < self.max_inflight - self._occupied:
                        bulk.append((stream, entry_id, deliveries))
                else:
                    suspects.append((stream, entry_id, deliveries))
        if bulk:
            await self._claim_and_start(bulk)
        if not suspects:
            return False
        # Isolation: stop claiming, let what runs finish, then take exactly one suspect (a random
        # one of the oldest, so workers reclaiming at once do not all contend for the same entry).
        self._isolating = True
        while self._running():
            if self._stopping.is_set():
                return False
            await asyncio.sleep(0.01)
        flights = await self._claim_and_start([random.choice(suspects[:8])])
        for flight in flights:
            log.warning("entry %s was in flight on a worker that died (delivery %d): running it alone",
                        flight.entry_id, flight.deliveries, extra=_ctx(flight))
            if flight.task is not None:
                await asyncio.wait([flight.task])
        return True

    async def _claim_and_start(self, chosen: list[tuple[str, str, int]]) -> list[InFlight]:
        flights = []
        for stream in self.request_streams:
            counts = {entry_id: n for s, entry_id, n in chosen if s == stream}
            if not counts:
                continue
            claimed = await self.redis.xclaim(stream, WORKERS_GROUP, self.name, self.settings.claim_idle_ms,
                                              list(counts))
            for raw_id, fields in claimed:
                entry_id = text(raw_id)
                if not fields or self._flight_key(stream, entry_id) in self._inflight:
                    continue
                self.stats.reclaimed += 1
                flights.append(self._start(stream, entry_id, fields, deliveries=counts[entry_id]))
        return flights

    def _start(self, stream: str, entry_id: str, fields: dict, deliveries: int, defer: bool = False) -> InFlight:
        key = self._flight_key(stream, entry_id)
        flight = InFlight(stream=stream, entry_id=entry_id, key=key, handle=f"{key}.{deliveries}",
                          deliveries=deliveries, claimed_at=time.time())
        self._inflight[key] = flight  # leased (renewed) from now on, even while deferred
        if defer:
            self._deferred.append((flight, fields))
        else:
            flight.task = asyncio.create_task(self._handle(flight, fields))
        return flight

    def _start_deferred(self) -> None:
        """Start entries that waited for a hold, an isolation or a free slot to end."""
        if self._holds or self._isolating or not self._deferred:
            return
        running = sum(1 for f in self._inflight.values() if f.task is not None and not f.released)
        while self._deferred and running < self.max_inflight:
            flight, fields = self._deferred.pop(0)
            if self._inflight.get(flight.key) is flight and flight.task is None:
                flight.task = asyncio.create_task(self._handle(flight, fields))
                running += 1

    def _release_slot(self, flight: InFlight) -> None:
        if not flight.released and self._inflight.get(flight.key) is flight:
            flight.released = True
            self._released += 1
            self._slot_free.set()

    def _running(self) -> bool:
        return any(f.task is not None and not f.task.done() for f in self._inflight.values())

    # ------------------------------------------------------------------ one request

    async def _handle(self, flight: InFlight, fields: dict) -> None:
        parked = False
        try:
            await self._process(flight, fields)
        except _AwaitWeights:
            # Leased but not running: it starts again once this worker's weights are new enough.
            parked = True
            flight.task = None
            self._awaiting_weights.append((flight, fields))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # engine or redis failure: retry elsewhere, never a hung request
            self.stats.engine_errors += 1
            rid = flight.request.request_id if flight.request else "?"
            log.exception("request %s (entry %s) failed: %s", rid, flight.entry_id, exc, extra=_ctx(flight))
            await self._record_error(flight, f"{self.name}: {type(exc).__name__}: {exc}"[:500])
            await self._hand_back(flight)
        finally:
            if flight.deadline_timer is not None:
                flight.deadline_timer.cancel()
            if not parked and self._inflight.pop(flight.key, None) is not None and flight.released:
                self._released -= 1
            self._slot_free.set()
            self._start_deferred()

    async def _process(self, flight: InFlight, fields: dict) -> None:
        max_deliveries = self.settings.max_deliveries
        if flight.deliveries > max_deliveries and not self._is_newer_schema(fields):
            # (a newer-schema entry keeps being handed back below: each reclaim counts as a
            # delivery, but it waits for a newer worker and is never dead-lettered for that)
            last = await self.redis.hget(self.keys.errors, flight.key)
            last = text(last) if last is not None else None
            reason = f"delivered {flight.deliveries} times (max_deliveries={max_deliveries})"
            if last:
                reason += f"; last error: {last}"
            await self._dead_letter(flight, fields, reason, request=self._try_decode(fields))
            return
        request: GenerationRequest | None = None
        try:
            request = decode_request(fields, self.settings.limits)
            self._check_served(request, self._part_of[flight.stream])
            self.engine.validate(request)
        except NewerSchemaError as exc:
            log.warning("entry %s: %s; handing it back for a newer worker", flight.entry_id, exc, extra=_ctx(flight))
            await self._hand_back(flight)
            return
        except ValidationError as exc:
            # A request that decoded but is not servable here (model, vocabulary, reply_to) still
            # names its waiter: pass it on so that the waiter gets its error record.
            await self._dead_letter(flight, fields, exc.reason, error=exc, request=request)
            return
        flight.request = request
        claimed_at = flight.claimed_at
        queue_ms = max(0.0, (claimed_at - request.submitted_at) * 1000.0)

        if flight.stop_status is None and self._is_aborted(request):
            flight.stop_status, flight.stop_reason = RecordStatus.ABORTED, "user"
        if flight.stop_status is None and request.deadline is not None and request.deadline <= time.time():
            flight.stop_status, flight.stop_reason = RecordStatus.EXPIRED, "deadline"
        if flight.stop_status is not None:
            record = CompletionRecord.failed(
                request, request_id=request.request_id, status=flight.stop_status,
                error=None if flight.stop_status is RecordStatus.ABORTED else "deadline passed before start",
                worker=self.name, n=request.n,
                meta_info={"worker": self.name, "attempt": flight.deliveries, "queue_ms": round(queue_ms, 3),
                           "weight_version": self.engine.info.weight_version, "abort_reason": flight.stop_reason})
            await self._finish(flight, request, record)
            return

        if request.min_weight_version is not None and not self._serves_version(request.min_weight_version):
            await self._check_weights_coming(flight, fields, request)
            return
        if request.deadline is not None:
            delay = max(0.0, request.deadline - time.time())
            flight.deadline_timer = asyncio.get_running_loop().call_later(
                delay, self._stop_generation, flight, RecordStatus.EXPIRED, "deadline")
        started = time.monotonic()
        output: EngineOutput = await self.engine.generate(request, flight.handle)
        engine_ms = (time.monotonic() - started) * 1000.0
        self._release_slot(flight)
        if flight.handed_back:
            return  # drained: the entry goes back to the fleet, this partial output is dropped
        status = flight.stop_status or (RecordStatus.ABORTED if output.aborted else RecordStatus.FINISHED)
        record = build_record(request, output, status=status, worker=self.name, info=self.engine.info,
                              attempt=flight.deliveries, queue_ms=queue_ms, engine_ms=engine_ms)
        if status is not RecordStatus.FINISHED:
            record.meta_info["abort_reason"] = flight.stop_reason or "engine"
        self.stats.tokens += record.meta_info.get("completion_tokens", 0)
        await self._finish(flight, request, record)

    def _serves_version(self, minimum: int) -> bool:
        have = _version_number(self.engine.info.weight_version)
        return have is not None and have >= minimum

    async def _check_weights_coming(self, flight: InFlight, fields: dict, request: GenerationRequest) -> None:
        """A request for newer weights than this worker has: wait for them if the pipeline's desired
        weights are new enough (an update is on its way), else dead-letter it."""
        desired = _version_number(text(await self.redis.hget(self.keys.weights, "weight_version") or b""))
        if desired is not None and desired >= request.min_weight_version:  # type: ignore[operator]
            log.info("request %s needs weight_version >= %s (have %s): waiting for the update",
                     request.request_id, request.min_weight_version, self.engine.info.weight_version,
                     extra=_ctx(flight))
            raise _AwaitWeights()
        reason = (f"min_weight_version {request.min_weight_version} is newer than the pipeline's desired "
                  f"weights ({desired if desired is not None else 'none set'})")
        await self._dead_letter(flight, fields, reason, request=request)

    def _resume_parked(self) -> None:
        parked, self._awaiting_weights = self._awaiting_weights, []
        for flight, fields in parked:
            if self._inflight.get(flight.key) is flight:
                flight.task = asyncio.create_task(self._handle(flight, fields))

    def _check_served(self, request: GenerationRequest, part: Keys) -> None:
        reply_to = request.reply_to
        if reply_to is not None and (part.tag, reply_to) not in self._reply_keys_ok:
            if not part.is_reply_key(reply_to):
                raise ValidationError("reply_to", f"{request.reply_to!r} is not a result or reply stream of this pipeline")
            if len(self._reply_keys_ok) > 10_000:
                self._reply_keys_ok.clear()
            self._reply_keys_ok.add((part.tag, reply_to))
        if request.model is not None and request.model != self.engine.info.model:
            raise ValidationError("model", f"{request.model!r} is not served here (this pipeline serves "
                                           f"{self.engine.info.model!r})")

    def _is_aborted(self, request: GenerationRequest) -> bool:
        """From the worker's copy of ``{ns}:aborted`` (loaded at start, then kept current from the
        control stream): no round trip per request. An abort that lands after this check finds
        the request in flight and stops it in the engine, so the outcome is the same."""
        if not self._aborted:
            return False
        if aborted_member(request_id=request.request_id) in self._aborted:
            return True
        return request.group_id is not None and aborted_member(group_id=request.group_id) in self._aborted

    async def _load_aborted(self) -> None:
        since = time.time() - ABORTED_RETENTION_S
        for member, score in await self.redis.zrangebyscore(self.keys.aborted, since, "+inf", withscores=True):
            self._aborted[text(member)] = float(score)

    def _remember_aborted(self, cmd: ControlCommand) -> None:
        for rid in cmd.request_ids:
            self._aborted[aborted_member(request_id=rid)] = cmd.sent_at
        for gid in cmd.group_ids:
            self._aborted[aborted_member(group_id=gid)] = cmd.sent_at
        if len(self._aborted) > 10_000 and len(self._aborted) % 1000 == 0:
            cutoff = time.time() - ABORTED_RETENTION_S
            self._aborted = {m: t for m, t in self._aborted.items() if t >= cutoff}

    def _stop_generation(self, flight: InFlight, status: RecordStatus, reason: str = "user") -> None:
        if flight.stop_status is None:
            flight.stop_status, flight.stop_reason = status, reason
        self.engine.abort(flight.handle)

    def _is_newer_schema(self, fields: dict) -> bool:
        try:
            decode_request(fields, self.settings.limits)
        except NewerSchemaError:
            return True
        except ValidationError:
            pass
        return False

    def _try_decode(self, fields: dict) -> GenerationRequest | None:
        try:
            return decode_request(fields, self.settings.limits)
        except ValidationError:
            return None

    # ------------------------------------------------------------------ publishing

    async def _finish(self, flight: InFlight, request: GenerationRequest, record: CompletionRecord) -> None:
        part = self._part_of[flight.stream]
        reply_key = request.reply_to or part.results
        cap = self.settings.results_max_len if reply_key == part.results else 0
        flight.publishing = True
        rid_key = part.rid(request.request_id)
        def publish() -> Any:
            return self.publisher.finish(stream=flight.stream, entry_id=flight.entry_id, reply_key=reply_key,
                                         rid_key=rid_key, record=record, cap=cap)

        try:
            published = await publish()
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            published = await self._retrying(publish)  # a short outage: retried while the lease holds
        if published:
            self.stats.published += 1
            self.stats.by_status[record.status.value] = self.stats.by_status.get(record.status.value, 0) + 1
            if self.metrics is not None:
                self.metrics.observe(record.meta_info.get("queue_ms"), record.meta_info.get("engine_ms"))
            if flight.deliveries > 1:
                await self.redis.hdel(self.keys.errors, flight.key)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("request %s %s", request.request_id, record.status.value, extra=_ctx(flight))
        else:
            self.stats.fenced += 1
            log.warning("request %s: lease lost (entry %s now owned elsewhere); output dropped",
                        request.request_id, flight.entry_id, extra=_ctx(flight))

    async def _dead_letter(self, flight: InFlight, fields: dict, reason: str, *,
                           error: ValidationError | None = None, request: GenerationRequest | None = None) -> None:
        part = self._part_of[flight.stream]
        request_id = request.request_id if request else (error.request_id if error else None)
        reply_to = request.reply_to if request else (error.reply_to if error else None)
        if request_id is not None and reply_to is None:
            reply_to = part.results
        if reply_to is not None and not part.is_reply_key(reply_to):
            reply_to = None  # never write outside the pipeline's own streams
        record = None
        if request_id is not None and reply_to is not None:
            record = CompletionRecord.failed(request, request_id=request_id, status=RecordStatus.ERROR,
                                             error=reason, worker=self.name,
                                             n=request.n if request else 1,
                                             meta_info={"worker": self.name, "attempt": flight.deliveries})
        flight.publishing = True
        letter = DeadLetter(stream=flight.stream, entry_id=flight.entry_id, reason=reason, source="worker",
                            fields=fields, deliveries=flight.deliveries, delete_entry=True,
                            reply_to=reply_to if record else None, error_record=record,
                            rid_key=part.rid(request_id) if request_id else None)
        done = await self._retrying(lambda: self.batcher.call(lambda pipe: self.scripts.dead_letter_in(
            pipe, dead_key=part.dead, group=WORKERS_GROUP, consumer=self.name, letter=letter)))
        if int(done) == 1:
            self.stats.dead_lettered += 1
            if flight.deliveries > 1:
                await self.redis.hdel(self.keys.errors, flight.key)
            log.warning("request %s (entry %s) dead-lettered: %s", request_id or "?", flight.entry_id, reason,
                        extra={"request_id": request_id, "entry_id": flight.entry_id})
        else:
            self.stats.fenced += 1

    async def _record_error(self, flight: InFlight, error: str) -> None:
        """Keep the last engine error of an entry where whichever worker dead-letters it can read it."""
        try:
            await self.redis.hset(self.keys.errors, flight.key, error)
        except redis.RedisError as exc:
            log.warning("could not record the error of %s: %s", flight.entry_id, exc)

    async def _hand_back(self, flight: InFlight) -> None:
        """Give an entry back to the fleet now (owner-checked; the delivery count is not raised)."""
        try:
            lost = await self.scripts.renew(flight.stream, WORKERS_GROUP, self.name, [flight.entry_id],
                                            idle_ms=self.settings.claim_idle_ms)
            if not lost:
                self.stats.handed_back += 1
        except redis.RedisError as exc:
            log.warning("hand-back of %s failed (%s); it will be reclaimed after claim_idle", flight.entry_id, exc)

    async def _retrying(self, call: Any, attempts: int = 8) -> Any:
        """Retry a Redis call through short outages while the lease is still ours."""
        delay = 0.1
        for i in range(attempts):
            try:
                return await call()
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                if i == attempts - 1:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    # ------------------------------------------------------------------ control, leases, heartbeat

    async def _control_loop(self) -> None:
        while not self._stopping.is_set():
            resp = await self.redis.xread({self.keys.control: self._control_last_id}, count=100, block=self.block_ms)
            for _stream, entries in resp or []:
                for entry_id, fields in entries:
                    self._control_last_id = text(entry_id)
                    cmd = ControlCommand.from_fields(fields)
                    if cmd is not None:
                        self.apply_control(cmd)

    def apply_control(self, cmd: ControlCommand) -> None:
        if cmd.target not in (None, "*", self.name):
            return
        if cmd.kind == "abort":
            self._remember_aborted(cmd)
            rids, gids = set(cmd.request_ids), set(cmd.group_ids)
            for flight in list(self._inflight.values()):
                req = flight.request
                if req is not None and (req.request_id in rids or (req.group_id is not None and req.group_id in gids)):
                    log.info("request %s: abort", req.request_id, extra=_ctx(flight))
                    self._stop_generation(flight, RecordStatus.ABORTED)
            if self._awaiting_weights:
                self._resume_parked()  # parked ones re-check: aborted ones publish now, others park again
        elif cmd.kind == "drain":
            log.info("drain requested through the control stream")
            self.request_stop()
        elif cmd.kind in ("update_weights", "release_memory", "resume_memory"):
            task = asyncio.create_task(self._run_engine_command(cmd))
            self._control_tasks.add(task)
            task.add_done_callback(self._control_tasks.discard)

    # ------------------------------------------------------------------ weights and memory

    async def _run_engine_command(self, cmd: ControlCommand) -> None:
        try:
            if cmd.kind == "update_weights":
                await self.update_weights(str(cmd.args["model_path"]), cmd.args.get("weight_version"),
                                          abort_inflight=bool(cmd.args.get("abort_inflight", False)))
            elif cmd.kind == "release_memory":
                await self.release_memory()
            elif cmd.kind == "resume_memory":
                await self.resume_memory()
        except Exception:
            log.exception("control command %s failed", cmd.kind)

    async def _quiesce(self, hold: str, abort_inflight: bool = False) -> None:
        """Stop claiming and wait until nothing is in flight (aborting it first when asked)."""
        self._holds.add(hold)
        if abort_inflight:
            for flight in list(self._inflight.values()):
                if flight.task is not None:  # deferred ones simply run later, on the new weights
                    self._stop_generation(flight, RecordStatus.ABORTED, "weight_update")
        while self._running() and not self._stopping.is_set():
            await asyncio.sleep(0.01)

    def _release_hold(self, hold: str) -> None:
        self._holds.discard(hold)
        self._slot_free.set()
        self._start_deferred()

    async def update_weights(self, model_path: str, weight_version: str | None, *,
                             abort_inflight: bool = False) -> None:
        """Stop claiming, let in-flight requests finish (or abort them: with collect_unfinished their
        partial output is published), load the new weights, resume. Records generated after this
        carry the new weight_version; none generated before do."""
        async with self._weights_lock:
            if weight_version is not None and weight_version == self.engine.info.weight_version:
                return
            log.info("weight update to %s (version %s): pausing claims", model_path, weight_version)
            await self._quiesce("weights", abort_inflight)
            try:
                update = getattr(self.engine, "update_weights_from_disk", None)
                if update is None:
                    raise RuntimeError(f"the {self.engine.info.name} engine cannot update weights")
                await update(model_path, weight_version)
                log.info("weights now at version %s", self.engine.info.weight_version)
                await self._heartbeat()
                self._resume_parked()
            finally:
                self._release_hold("weights")

    async def release_memory(self) -> None:
        """Free engine memory for a colocated trainer; claiming stays paused until resume."""
        await self._quiesce("memory")
        release = getattr(self.engine, "release_memory_occupation", None)
        if release is not None:
            await release()
        await self._heartbeat()

    async def resume_memory(self) -> None:
        resume = getattr(self.engine, "resume_memory_occupation", None)
        if resume is not None:
            await resume()
        self._release_hold("memory")
        await self._heartbeat()

    async def _load_desired_weights(self) -> None:
        """A worker that joins late loads the desired weights before claiming anything."""
        desired = await self.redis.hgetall(self.keys.weights)
        if not desired:
            return
        version = text(desired.get(b"weight_version", b"")) or None
        path = text(desired.get(b"model_path", b"")) or None
        if version is not None and path is not None and version != self.engine.info.weight_version:
            await self.update_weights(path, version)

    async def _gc_loop(self) -> None:
        """Housekeeping every ``gc_interval_s``: expired reply streams, gone workers, empty consumers."""
        while not self._stopping.is_set():
            await self._pause(self.settings.gc_interval_s)
            if self._stopping.is_set():
                return
            report = await collect_garbage(self.redis, self.keys, reply_ttl_s=self.settings.reply_ttl_s,
                                           partitions=self.parts)
            if report.total:
                log.info("housekeeping removed %s", report.to_json())

    async def _lease_loop(self) -> None:
        # Runs through the drain too (it is cancelled once the worker has stopped): work that is
        # still finishing keeps its leases, and the heartbeat says "draining".
        while True:
            await asyncio.sleep(self.lease_interval_s)
            await self.renew_leases()
            await self._heartbeat()

    async def renew_leases(self) -> None:
        flights = [f for f in self._inflight.values() if not f.handed_back]
        if not flights:
            return
        lost: set[str] = set()
        for stream in self.request_streams:
            ids = [f.entry_id for f in flights if f.stream == stream]
            lost |= {self._flight_key(stream, i) for i in await self.scripts.renew(stream, WORKERS_GROUP, self.name, ids)}
        for f in flights:
            if f.key in lost and not f.lease_lost and not f.publishing and self._inflight.get(f.key) is f:
                f.lease_lost = True
                self.stats.lease_losses += 1
                log.warning("lease on entry %s lost; stopping its generation", f.entry_id, extra=_ctx(f))
                self.engine.abort(f.handle)

    def _rates(self, window_s: float = 60.0) -> dict[str, float]:
        """Requests and tokens per second over the last ``window_s`` (from heartbeat samples)."""
        now = time.monotonic()
        self._rate_samples.append((now, self.stats.published, self.stats.tokens))
        while len(self._rate_samples) > 2 and now - self._rate_samples[1][0] >= window_s:
            self._rate_samples.popleft()
        t0, p0, k0 = self._rate_samples[0]
        span = now - t0
        if span <= 0:
            return {"requests_per_s_1m": 0.0, "tokens_per_s_1m": 0.0}
        return {"requests_per_s_1m": round((self.stats.published - p0) / span, 3),
                "tokens_per_s_1m": round((self.stats.tokens - k0) / span, 3)}

    def _state(self) -> str:
        if self._stopping.is_set():
            return "draining"
        if "memory" in self._holds:
            return "released"
        if "weights" in self._holds:
            return "updating"
        return "running"

    async def _heartbeat(self) -> None:
        info = self.engine.info
        beat = {
            "host": socket.gethostname(), "pid": os.getpid(), "engine": info.name, "model": info.model,
            "weight_version": info.weight_version, "inflight": len(self._inflight),
            "max_inflight": self.max_inflight, "started": round(self._started_at, 3), "seen": round(time.time(), 3),
            "published": self.stats.published, "tokens": self.stats.tokens, "fenced": self.stats.fenced,
            "lease_losses": self.stats.lease_losses, "dead_lettered": self.stats.dead_lettered,
            "state": self._state(), **self._rates(),
        }
        await self.redis.hset(self.keys.workers, self.name, json.dumps(beat, separators=(",", ":")))
