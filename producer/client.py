"""The async producer client: submit requests, await or call back on their records.

A producer reads its own reply stream ``{ns}:reply:<name>`` through consumer group
``producer`` (consumer ``<name>``), so two producers never take each other's results, and a
restarted producer with the same name finds the records it had not yet handled.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import secrets
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterable, Mapping

import msgspec
import redis
from redis.asyncio import Redis

from redroll.errors import RedrollError
from redroll.shared.codec import (
    ValidationError,
    check_request_id,
    decode_record,
    decode_sampling_params,
    encode_request,
)
from redroll.shared.connection import connect, open_connections, reach, read_groups
from redroll.shared.control import abort_requests
from redroll.shared.control import update_weights as _update_weights
from redroll.shared.events import EventLog
from redroll.shared.keys import PRODUCER_GROUP, Keys, lane_index
from redroll.shared.lanes import agree_on_lanes
from redroll.shared.refusals import StreamRefusedError, is_transient
from redroll.shared.scripts import DeadLetter, DuplicateRequestError, Scripts, raising_first_error
from redroll.shared.settings import Settings
from redroll.shared.streams import (
    drop_read,
    ensure_group,
    is_unblocked,
    read_count,
    read_group,
    text,
    unique_consumer_name,
)
from redroll.shared.tracing import end_span, submit_span, tracer
from redroll.shared.types import CompletionRecord, GenerationRequest, RecordStatus, SamplingParams

from . import dead_notices
from .rollout import RolloutGroup, continuation, group_members, stitch

if TYPE_CHECKING:
    from .session import Session

log = logging.getLogger("redroll.producer")

Callback = Callable[[CompletionRecord], Any]


def make_request(
    *,
    request_id: str | None = None,
    prompt: str | None = None,
    input_ids: list[int] | None = None,
    sampling_params: SamplingParams | Mapping[str, Any] | None = None,
    **fields: Any,
) -> GenerationRequest:
    """Build a request from plain values; ``sampling_params`` may be a dict (validated here)."""
    if not isinstance(sampling_params, SamplingParams):
        sampling_params = decode_sampling_params(dict(sampling_params or {}))
    return GenerationRequest(
        request_id=request_id or uuid.uuid4().hex,
        prompt=prompt,
        input_ids=list(input_ids) if input_ids is not None else None,
        sampling_params=sampling_params,
        **fields,
    )


def request_stream(keys: Keys, request: GenerationRequest) -> str:
    """The stream a request is queued on: high priority has its own, claimed first; with affinity
    lanes, a request with an affinity key (or a group) queues on its lane; the rest on the shared one."""
    if request.priority:
        return keys.requests_high
    if keys.lanes and request.lane_key:
        return keys.lane(lane_index(request.lane_key, keys.lanes))
    return keys.requests


class BeforeAckError(RedrollError, RuntimeError):
    """The producer's ``before_ack`` raised (its error is the cause): the records it was to make
    last were applied here, and their reply entries were not acked."""


@dataclass
class _Waiter:
    future: asyncio.Future
    callback: Callback | None


def _refuse_repeated_ids(items: list[GenerationRequest | Mapping[str, Any]]) -> None:
    """One waiter per request_id: a call naming one twice is refused before anything is sent (the
    second waiter replaced the first, which then never resolved)."""
    seen: set[str] = set()
    for item in items:
        rid = item.request_id if isinstance(item, GenerationRequest) else item.get("request_id")
        if rid is None:
            continue  # (named at random when made)
        if rid in seen:
            raise ValueError(f"request_id {rid!r} appears twice in one submit: nothing was sent")
        seen.add(rid)


class Producer:
    """Submit generation requests and receive their records.

    Use as ``async with Producer(settings) as p: rec = await (await p.submit(prompt="hi"))``.
    """

    RECENT_LIMIT = 100_000
    """How many applied request_ids are remembered to skip duplicate records."""

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        redis_client: Redis | None = None,
        name: str | None = None,
        block_ms: int = 1000,
        read_count: int = 256,
        max_inflight: int | None = None,
        max_staleness: int | None = None,
        batch_size: int | None = None,
        tokens_from_ids: bool = False,
        before_ack: Callable[[], None] | None = None,
    ):
        """``max_inflight``: at most this many requests outstanding; ``submit`` waits for room
        (backpressure: nothing is dropped). ``max_staleness`` with ``batch_size``: AReaL's capacity
        rule, at most ``(max_staleness + weight_version + 1) * batch_size`` requests admitted in all
        (aborted and failed ones are given back), so no sample is generated more than
        ``max_staleness`` versions behind the trainer; ``weight_version`` advances with
        :meth:`update_weights` or :meth:`set_weight_version`.

        ``tokens_from_ids``: each submit's de-duplication token is made from the producer's
        ``name`` and the request_id instead of at random. A later producer of the same name (a
        restarted process) that submits a request still queued or in flight then gets that submit
        back, not a refusal and not a second entry, and its record on the same reply stream; one
        that finished meanwhile gets the record that came to that stream (held for
        :meth:`unclaimed` until then), and is not sent again. That is how ``redroll submit
        --resume`` takes over an interrupted run.

        ``before_ack()`` runs before the reply entries of applied records are acked, after their
        callbacks: where what the callbacks did is made to last (a file flushed), so that a process
        killed at any instant leaves each record either applied or still on its reply stream. While
        it raises, those entries stay unacked (:class:`BeforeAckError`, logged by the reader, which
        reads them again and tries again later; their callbacks do not run again)."""
        if max_staleness is not None and not batch_size:
            raise ValueError("max_staleness needs batch_size (AReaL's capacity rule)")
        if max_inflight is not None and max_inflight < 1:
            raise ValueError("max_inflight must be at least 1")
        self.max_inflight = max_inflight
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self.weight_version = 0
        self.admitted = 0
        self._room = asyncio.Condition()
        self._groups: dict[str, list[str]] = {}
        self.settings = settings or Settings.from_env()
        self.keys: Keys = self.settings.keys
        self.name = name or unique_consumer_name("producer")
        check_request_id(self.name, "producer name")
        self.parts: list[Keys] = self.settings.partition_keys
        self.reply_streams = [part.reply(self.name) for part in self.parts]
        """One private reply stream per partition (a record is written in its request's partition)."""
        self.reply_to = self.reply_streams[0]
        """The reply stream (of partition 0 when the pipeline is partitioned)."""
        self.block_ms = block_ms
        self.read_count = read_count
        self._redis = redis_client
        self._tracer: Any = None
        self._owns_redis = redis_client is None
        self._waiters: dict[str, _Waiter] = {}
        self._unclaimed: dict[str, tuple[str, CompletionRecord]] = {}
        self._unclaimed_event = asyncio.Event()
        self._recent: dict[str, tuple[tuple[str, str] | None, CompletionRecord | None]] = {}
        """request_id → (the entry its record was applied from, a later record of the same id or None)."""
        self._readers: list[asyncio.Task] = []
        self._closed = False
        self._last_expire = 0.0
        self._tokens_from_ids = tokens_from_ids
        self._before_ack = before_ack

    # ------------------------------------------------------------------ lifecycle

    @property
    def redis(self) -> Redis:
        if self._redis is None:
            raise RuntimeError("producer not started: use 'async with Producer(...)' or 'await start()'")
        return self._redis

    async def start(self) -> "Producer":
        if self._redis is None:
            self._redis = connect(self.settings)
        self.scripts = Scripts(self._redis, EventLog.from_settings(self.settings))
        self._tracer = tracer()
        await reach(self._redis, self.settings)
        await open_connections(self._redis, 4)  # (its reply and dead-letter readers block; submits, acks)
        await agree_on_lanes(self._redis, self.settings.keys, self.settings.affinity_lanes)
        for stream in self.reply_streams:
            await ensure_group(self._redis, stream, PRODUCER_GROUP)
            await self._redis.expire(stream, self.settings.reply_ttl_s)
        groups = read_groups(self._redis, self.reply_streams)  # one reader per group
        for g in groups:
            await self._read_what_came(g)
        self._readers = [asyncio.create_task(self._read_loop(g), name=f"producer-reader-{self.name}-{i}")
                         for i, g in enumerate(groups)]
        for i, g in enumerate(read_groups(self._redis, [part.dead for part in self.parts])):
            positions = await dead_notices.start_positions(self._redis, g)
            self._readers.append(asyncio.create_task(dead_notices.watch(
                self._redis, positions, set(self.reply_streams), self._resolve_notice, block_ms=self.block_ms,
                closed=lambda: self._closed), name=f"producer-dead-watch-{self.name}-{i}"))
        return self

    async def close(self) -> None:
        self._closed = True
        await self._notify_room()
        for reader in self._readers:
            reader.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        for w in self._waiters.values():
            if not w.future.done():
                w.future.cancel()
        if self._owns_redis and self._redis is not None:
            await self._redis.aclose()

    async def __aenter__(self) -> "Producer":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # ------------------------------------------------------------------ submitting

    async def submit(
        self,
        request: GenerationRequest | None = None,
        *,
        callback: Callback | None = None,
        **fields: Any,
    ) -> asyncio.Future:
        """Queue one request; returns a future resolved with its record.

        ``callback(record)`` (sync or async) runs once when the record arrives, then is dropped.
        Raises :class:`DuplicateRequestError` if another live submit holds the request_id, and
        :class:`ValidationError` for a request no worker would accept.
        """
        futures = await self.submit_many([request or make_request(**fields)], callback=callback)
        return futures[0]

    async def generate(self, request: GenerationRequest | None = None, *, timeout: float | None = None,
                       **fields: Any) -> CompletionRecord:
        """Submit one request and wait for its record (``await (await p.submit(...))`` in one call);
        ``timeout`` in seconds raises :class:`TimeoutError` (the request stays queued or running:
        :meth:`result` or :meth:`abort` it)."""
        future = await self.submit(request, **fields)
        return await asyncio.wait_for(asyncio.shield(future), timeout)

    async def submit_many(
        self,
        requests: Iterable[GenerationRequest | Mapping[str, Any]],
        *,
        callback: Callback | None = None,
        validated: bool = False,
    ) -> list[asyncio.Future]:
        """Queue many requests in pipelined round trips; one future per request, in order.

        With ``max_inflight`` / ``max_staleness`` set this waits for room, chunk by chunk.
        ``validated``: each request already passed :func:`~redroll.shared.codec.encode_request`
        with this producer's limits (``redroll submit`` checks its whole file first), so it is
        encoded without being decoded again; only its ``reply_to`` changes here.
        """
        items = list(requests)
        _refuse_repeated_ids(items)
        if self.max_inflight is None and self.max_staleness is None:
            return await self._submit_chunk(items, callback, validated)
        futures: list[asyncio.Future] = []
        step = self.max_inflight or len(items) or 1
        i = 0
        while i < len(items):
            room = await self._wait_for_room()
            chunk = items[i:i + min(step, room)]
            futures += await self._submit_chunk(chunk, callback, validated)
            i += len(chunk)
        return futures

    def _room_now(self) -> int:
        room = 1 << 30
        if self.max_inflight is not None:
            room = min(room, self.max_inflight - len(self._waiters))
        if self.max_staleness is not None and self.batch_size:
            room = min(room, (self.max_staleness + self.weight_version + 1) * self.batch_size - self.admitted)
        return room

    async def _wait_for_room(self) -> int:
        async with self._room:
            await self._room.wait_for(lambda: self._room_now() > 0 or self._closed)
            return max(1, self._room_now())

    async def _notify_room(self) -> None:
        async with self._room:
            self._room.notify_all()

    def set_weight_version(self, version: int) -> None:
        """The trainer's current weight version (for the staleness bound)."""
        self.weight_version = int(version)
        asyncio.get_running_loop().create_task(self._notify_room())

    async def _submit_chunk(self, requests: list, callback: Callback | None,
                            validated: bool = False) -> list[asyncio.Future]:
        prepared: list[tuple[GenerationRequest, dict[str, bytes], str]] = []
        token_base = f"{self.name}:{secrets.token_hex(8)}"  # (one random part per chunk, then its index)
        spans = []  # (OpenTelemetry, when a tracer provider is set: shared/tracing.py)
        for i, item in enumerate(requests):
            req = item if isinstance(item, GenerationRequest) else make_request(**dict(item))
            req.reply_to = self.settings.keys_for(req).reply(self.name)
            if self._tracer is not None:
                spans.append(submit_span(self._tracer, req))
            fields = encode_request(req, self.settings.limits, check=not validated)
            # (neither a name nor a request_id holds whitespace, which ends a token in the rid key)
            token = f"{self.name}:{req.request_id}" if self._tokens_from_ids else f"{token_base}:{i}"
            prepared.append((req, fields, token))
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future] = []
        for req, _, _ in prepared:
            if req.request_id in self._waiters:
                raise DuplicateRequestError(req.request_id)
        for req, _, _ in prepared:
            fut = loop.create_future()
            self._waiters[req.request_id] = _Waiter(fut, callback)
            futures.append(fut)
        self.admitted += len(prepared)
        came = await self._resolve_held(prepared) if self._tokens_from_ids and self._unclaimed else set()
        sending = [(item, fut) for item, fut in zip(prepared, futures) if item[0].request_id not in came]
        try:
            replies = await self._submit_until_accepted([item for item, _ in sending]) if sending else []
        except BaseException:
            for (req, _, _), _fut in sending:
                self._waiters.pop(req.request_id, None)
            self.admitted -= len(sending)
            raise
        failed: Exception | None = None
        for ((req, _, _), fut), reply in zip(sending, replies):
            try:
                Scripts.submit_outcome(req.request_id, reply)
            except (DuplicateRequestError, StreamRefusedError) as exc:
                self._waiters.pop(req.request_id, None)
                self.admitted -= 1
                fut.set_exception(exc)
                fut.exception()  # mark retrieved; the error is raised below
                failed = failed or exc
        for span in spans:
            end_span(span)
        if failed is not None and len(prepared) == 1:
            raise failed
        return futures

    async def _resolve_held(self, prepared: list) -> set[str]:
        """Under ``tokens_from_ids``, a record held here (nobody waited for it) for a request_id
        about to be submitted is the outcome of this name's earlier submit of it, by a process
        that stopped before it finished: the submit gets that record, and nothing is sent for it
        (it would be generated again). Returns those request_ids."""
        held = {req.request_id: self._unclaimed.pop(req.request_id) for req, _, _ in prepared
                if req.request_id in self._unclaimed}
        applied = [entry_id for entry_id, record in held.values() if await self._resolve(record, entry_id)]
        try:
            await self._ack(applied)
        except BeforeAckError as exc:  # (they stay pending here: the reader reads them again, and acks them)
            log.error("%s", exc)
        return set(held)

    async def _submit_until_accepted(self, prepared: list) -> list:
        return await submit_until_accepted(lambda items: self._submit_with_retry(items), prepared,
                                           f"producer {self.name}")

    async def _submit_with_retry(self, prepared: list, attempts: int = 8) -> list:
        """Send the submit scripts; a retry after a dropped connection reuses each submit's token,
        so a request the server already took is reported as submitted, not refused."""
        delay = 0.1
        for attempt in range(attempts):
            try:
                return await submit_batch(self.redis, self.scripts, self.settings,
                                          [(req, fields["data"], token) for req, fields, token in prepared])
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                if attempt == attempts - 1:
                    raise
                log.warning("submit failed (%s); retrying in %.1fs with the same tokens", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ receiving

    async def result(self, request_id: str, timeout: float | None = None, *, fresh: bool = False) -> CompletionRecord:
        """The record of ``request_id``: one submitted here, or (after a restart) before.

        A record already handed out raises LookupError, unless ``fresh``: then wait for a new
        record of that id (after ``redroll dead requeue``, say).
        """
        waiter = self._waiters.get(request_id)
        if waiter is None and request_id in self._recent:
            if not fresh:
                raise LookupError(f"the record of {request_id!r} was already delivered by this producer")
            later = self._recent.pop(request_id)[1]
            if later is not None:
                return later  # a newer record of this id arrived before this call
        if waiter is None:
            held = self._unclaimed.pop(request_id, None)
            if held is not None:
                self._remember(request_id, held[0])
                await self._ack([held[0]])
                return held[1]
            waiter = _Waiter(asyncio.get_running_loop().create_future(), None)
            self._waiters[request_id] = waiter
        return await asyncio.wait_for(asyncio.shield(waiter.future), timeout)

    async def as_completed(self, futures: Iterable[asyncio.Future]) -> AsyncIterator[CompletionRecord]:
        """Yield records in the order they complete."""
        for fut in asyncio.as_completed(list(futures)):
            yield await fut

    async def unclaimed(self) -> AsyncIterator[CompletionRecord]:
        """Records nobody in this process waits for (e.g. submitted before a restart), as they arrive."""
        while not self._closed:
            while self._unclaimed:
                rid, (entry_id, rec) = next(iter(self._unclaimed.items()))
                del self._unclaimed[rid]
                self._remember(rid, entry_id)
                await self._ack([entry_id])
                yield rec
            self._unclaimed_event.clear()
            await self._unclaimed_event.wait()

    @property
    def outstanding(self) -> int:
        """Requests submitted here whose record has not arrived yet."""
        return len(self._waiters)

    async def abort(self, request_ids: Iterable[str] = (), *, group_id: str | None = None) -> list[str]:
        """Abort by request_id or group_id: queued ones first, each cancelled in the queue at once
        (atomically: its aborted record is published and its entry deleted, unless a worker took
        it meanwhile); then the rest is aborted in flight by its worker. (In that order: an
        in-flight abort frees slots, and workers would claim the queued ones next.) Returns the
        request_ids cancelled while still queued."""
        members = self._groups.get(group_id, []) if group_id is not None else []
        return await abort_requests(self.redis, self.keys, request_ids, group_ids=[group_id] if group_id else [],
                                    known_members=members, parts=self.parts, what=f"producer {self.name}: abort")

    async def submit_group(self, n: int, *, group_id: str | None = None, callback: Callback | None = None,
                           **fields: Any) -> RolloutGroup:
        """One prompt's ``n`` samples as ``n`` single-sample requests sharing ``group_id``
        (member ids ``<group_id>_000`` …); see :class:`redroll.producer.rollout.RolloutGroup`."""
        group_id = group_id or uuid.uuid4().hex
        members = group_members(group_id, n, dict(fields))
        futures = await self.submit_many(members, callback=callback)
        ids = [m["request_id"] for m in members]
        self._groups[group_id] = ids
        return RolloutGroup(self, group_id, dict(zip(ids, futures)))

    def session(self, key: str | None = None) -> "Session":
        """A multi-turn conversation whose turns share ``key`` as their affinity key (see
        :class:`redroll.producer.session.Session`)."""
        from .session import Session

        return Session(self, key) if key else Session(self)

    async def generate_resumable(self, request: GenerationRequest | None = None, *, max_segments: int = 16,
                                 **fields: Any) -> CompletionRecord:
        """Generate one sample that survives weight updates with ``abort_inflight``: each time it is
        cut short by one, resubmit prompt + partial tokens with the remaining budget, then stitch
        the segments (ids, logprobs, per-segment weight versions) into one record."""
        original = request or make_request(**fields)
        if original.n != 1:
            raise ValueError("generate_resumable is single-sample; use submit_group for n samples")
        original = msgspec.structs.replace(original, collect_unfinished=True)
        segments: list[CompletionRecord] = []
        current: GenerationRequest | None = original
        while current is not None and len(segments) < max_segments:
            rec = await (await self.submit(current))
            segments.append(rec)
            if rec.status is not RecordStatus.ABORTED or rec.meta_info.get("abort_reason") != "weight_update":
                break
            so_far = [t for seg in segments for t in seg.output_token_ids[0]]
            current = continuation(original, so_far, len(segments))
        return stitch(original.request_id, segments)

    async def update_weights(self, model_path: str, weight_version: str, *, abort_inflight: bool = False,
                             mode: str | None = None, wait: bool = True,
                             timeout: float = 600.0) -> dict[str, dict[str, Any]]:
        """Broadcast new weights to the fleet; with ``wait``, return once every live worker runs them.

        Workers stop claiming, let in-flight requests finish (``abort_inflight``: abort them, so
        ``collect_unfinished`` requests return their partial output), load, and resume; with
        ``mode="in_place"`` they load while requests run and swap between two decode steps (each
        token's version is in its record). Workers that join later load the desired weights from
        ``{ns}:weights`` before claiming.
        """
        workers = await _update_weights(self.redis, self.keys, model_path, weight_version,
                                        abort_inflight=abort_inflight, mode=mode, wait=wait,  # type: ignore[arg-type]
                                        timeout=timeout)
        if str(weight_version).isdigit():
            self.set_weight_version(int(weight_version))
        return workers

    def weight_sync(self, **options: Any) -> Any:
        """Push a trainer's weights to the fleet over torch.distributed (see
        :class:`redroll.producer.weight_sync.WeightSync` for the options)::

            async with producer.weight_sync(backend="gloo") as sync:
                await sync.push(model.named_parameters(), version="12")
        """
        from .weight_sync import WeightSync  # (torch is needed only for this)

        return WeightSync(self, **options)

    async def _read_what_came(self, streams: list[str]) -> None:
        """Deliver every record on ``streams`` now, without waiting for more: this name's pending
        entries (a restart resumes them), then the new ones. ``start`` returns after it, so a
        record that came before the first submit is held (a restarted producer with
        ``tokens_from_ids`` resolves a submit of its request from it, and does not send it again)."""
        count = self.read_count  # (fewer once records are large: see read_count)
        for stream in streams:
            last_id = "0"
            while last_id != ">":
                batch, last_id = await self._read_page(stream, last_id, count)
                count = read_count([e for _s, e in batch], self.read_count) if batch else count
                await self._deliver(batch)
        while True:
            asked = count
            batch = [(s, e) for s, es in await read_group(self.redis, PRODUCER_GROUP, self.name, streams,
                                                          count=asked) for e in es]
            count = read_count([e for _s, e in batch], self.read_count) if batch else count
            await self._deliver(batch)
            if len(batch) < asked:
                return

    async def _read_page(self, stream: str, last_id: str, count: int) -> tuple[list, str]:
        """A page of this name's pending entries on ``stream`` after ``last_id``: the entries, and
        where the next page starts (``>`` once none are left)."""
        resp = await self.redis.xreadgroup(PRODUCER_GROUP, self.name, {stream: last_id}, count=count)
        entries = [e for _s, es in (resp or []) for e in es]
        return [(stream, e) for e in entries], ">" if len(entries) < count else text(entries[-1][0])

    async def _read_loop(self, streams: list[str]) -> None:
        # New entries: our own pending ones were read before start returned (_read_what_came); they
        # are paged again ("0") after a connection error, a read that lost its reply, or a
        # before_ack that raised.
        last_ids = {stream: ">" for stream in streams}
        delay = 0.1
        recheck_s = min(self.settings.claim_idle_ms / 1000, 5.0)
        next_check = time.monotonic() + recheck_s
        count = self.read_count  # (fewer after large records: see read_count)
        # The next new-entries read, asked for before a batch is delivered (Redis builds its reply
        # meanwhile). None while paging, and none once the lost-reads check is due: the check counts
        # this reader's pending entries, which an outstanding read adds to.
        ahead: asyncio.Task | None = None
        try:
            while not self._closed:
                try:
                    paging = {s: i for s, i in last_ids.items() if i != ">"}
                    if not paging and ahead is None and time.monotonic() >= next_check:
                        next_check = time.monotonic() + recheck_s
                        if await self._lost_reads(streams):
                            last_ids = {stream: "0" for stream in streams}
                            continue
                    if paging:
                        stream, last_id = next(iter(paging.items()))
                        batch, last_ids[stream] = await self._read_page(stream, last_id, count)
                    else:
                        reading, ahead = ahead or self._read_new(streams, count), None
                        batch = [(s, e) for s, es in await reading for e in es]
                    if batch:
                        count = read_count([e for _s, e in batch], self.read_count)
                    if not paging and not self._closed and time.monotonic() < next_check:
                        ahead = self._read_new(streams, count)
                    await self._deliver(batch)
                    await self._refresh_ttl()
                    delay = 0.1
                except asyncio.CancelledError:
                    raise
                except BeforeAckError as exc:
                    ahead = drop_read(ahead)
                    log.error("reply reader: %s; trying again in %.1fs", exc, delay)
                    last_ids = {stream: "0" for stream in streams}  # (their acks come when they are read again)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)
                except redis.ResponseError as exc:  # (a read asked for ahead stays: the next turn awaits it)
                    if "NOGROUP" in str(exc):
                        for stream in streams:
                            await ensure_group(self.redis, stream, PRODUCER_GROUP)
                        continue
                    if is_unblocked(exc):
                        continue
                    log.exception("reply reader failed")
                    await asyncio.sleep(delay)
                except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                    ahead = drop_read(ahead)
                    log.warning("reply reader: redis unavailable (%s); retrying in %.1fs", exc, delay)
                    # A read the server ran before the connection dropped left its entries pending here,
                    # with no reply to deliver them: page this reader's own pending entries again.
                    last_ids = {stream: "0" for stream in streams}
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)
                except Exception as exc:
                    # Anything else (a cluster client giving up mid-failover: "TTL exhausted", a bug)
                    # must not end the reader for good: its waiters would wait forever.
                    ahead = drop_read(ahead)
                    log.exception("reply reader: %s; reading again in %.1fs", type(exc).__name__, delay)
                    last_ids = {stream: "0" for stream in streams}
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)
        finally:
            drop_read(ahead)

    def _read_new(self, streams: list[str], count: int) -> asyncio.Task:
        return asyncio.ensure_future(read_group(self.redis, PRODUCER_GROUP, self.name, streams, count=count,
                                                block=self.block_ms))

    async def _lost_reads(self, streams: list[str]) -> bool:
        """True when this reader has entries pending that it neither holds for :meth:`unclaimed`
        nor knows about: a read the server ran whose reply never came back. The client retries a
        read on a dropped connection by itself (the cluster client after a failover too), so the
        retried read (``>``) finds nothing new and no error tells the loop to page them again."""
        held = Counter(held_stream for (held_stream, _id), _rec in self._unclaimed.values())
        for stream in streams:
            summary = await self.redis.xpending(stream, PRODUCER_GROUP)
            mine = sum(c["pending"] for c in summary.get("consumers") or () if text(c["name"]) == self.name)
            if mine > held[stream]:
                log.warning("reply reader: %d record(s) on %s were read without a reply; reading them again",
                            mine - held[stream], stream)
                return True
        return False

    async def _deliver(self, entries: list) -> None:
        done: list[tuple[str, str]] = []
        for stream, (raw_id, fields) in entries:
            entry_id = (stream, text(raw_id))
            if not fields:
                done.append(entry_id)
                continue
            try:
                record = decode_record(fields)
            except ValidationError as exc:
                await self._dead_letter(entry_id, fields, exc.reason)
                continue
            if await self._resolve(record, entry_id):
                done.append(entry_id)
        await self._ack(done)
        if done and (self.max_inflight is not None or self.max_staleness is not None):
            await self._notify_room()

    async def _resolve(self, record: CompletionRecord, entry_id: tuple[str, str] | None = None) -> bool:
        """Hand ``record`` to its waiter (callback, future); True when its entry can be acked now
        (False: kept unacked for :meth:`unclaimed`, which acks it when it hands it out)."""
        waiter = self._waiters.pop(record.request_id, None)
        if waiter is None:
            if record.request_id in self._recent:
                # Already applied here: skipped (ROLL's pop). A record from another entry is kept
                # for result(fresh=True) (a requeued request's new record may arrive before that
                # call); the applied entry itself, read again after a lost ack, is not.
                applied_from = self._recent[record.request_id][0]
                if entry_id is None or entry_id != applied_from:
                    self._recent[record.request_id] = (applied_from, record)
            elif entry_id is not None and self._unclaimed.get(record.request_id, (None,))[0] == entry_id:
                return False  # the held entry itself, read again (a lost reply): pending until handed out
            elif record.request_id in self._unclaimed or entry_id is None:
                pass  # a duplicate of a record not yet handed out, or a notice nobody waits for
            else:
                self._unclaimed[record.request_id] = (entry_id, record)
                self._unclaimed_event.set()
                return False
            return True
        if waiter.callback is not None:
            try:
                res = waiter.callback(record)
                if inspect.isawaitable(res):
                    await res
            except Exception:
                log.exception("callback for request %s raised", record.request_id)
        if not waiter.future.done():
            waiter.future.set_result(record)
        self._remember(record.request_id, entry_id)
        if record.status is not RecordStatus.FINISHED:
            self.admitted -= 1  # no sample came of it: give its staleness capacity back
        return True

    async def _resolve_notice(self, record: CompletionRecord) -> None:
        """A dead letter says this request's record could not reach its reply stream."""
        if record.request_id in self._waiters:
            log.warning("request %s was dead-lettered and its reply stream refused the error record (%s)",
                        record.request_id, record.meta_info.get("reply_error"))
            await self._resolve(record)
            await self._notify_room()

    def _remember(self, request_id: str, entry_id: tuple[str, str] | None) -> None:
        """Remember applied request_ids (and the entry each came from) for a while, so a duplicate
        record is skipped, not re-applied."""
        self._recent[request_id] = (entry_id, None)
        if len(self._recent) > self.RECENT_LIMIT:
            self._recent.pop(next(iter(self._recent)))

    async def _ack(self, entries: list[tuple[str, str]]) -> None:
        """Ack and delete (stream, entry id) pairs: one transaction per reply stream."""
        if entries and self._before_ack is not None:
            try:
                self._before_ack()
            except Exception as exc:
                raise BeforeAckError(f"before_ack raised {exc!r}: {len(entries)} reply entries left unacked") from exc
        by_stream: dict[str, list[str]] = {}
        for stream, entry_id in entries:
            by_stream.setdefault(stream, []).append(entry_id)
        for stream, ids in by_stream.items():
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.xack(stream, PRODUCER_GROUP, *ids)
                pipe.xdel(stream, *ids)
                await pipe.execute()

    async def _dead_letter(self, entry: tuple[str, str], fields: dict, reason: str) -> None:
        stream, entry_id = entry
        part = self.parts[self.reply_streams.index(stream)]
        letter = DeadLetter(stream=stream, entry_id=entry_id, reason=reason, source="producer",
                            fields=fields, delete_entry=True)
        outcome = await self.scripts.dead_letter(dead_key=part.dead, group=PRODUCER_GROUP, consumer=self.name,
                                                 letter=letter)
        if outcome.refused is not None:
            log.error("undecodable record %s on %s: the dead stream refused its letter (%s); it stays pending "
                      "here and is tried again", entry_id, stream, outcome.refused)
        else:
            log.warning("undecodable record %s on %s dead-lettered: %s", entry_id, stream, reason)

    async def _refresh_ttl(self) -> None:
        now = time.monotonic()
        if now - self._last_expire > min(60.0, self.settings.reply_ttl_s / 4):
            self._last_expire = now
            for stream in self.reply_streams:
                await self.redis.expire(stream, self.settings.reply_ttl_s)


async def send(
    settings: Settings,
    redis_client: Redis,
    requests: Iterable[GenerationRequest],
    *,
    reply_to: str | None = None,
) -> list[str]:
    """Fire-and-forget: queue requests whose records go to ``reply_to`` (default ``{ns}:results``),
    for consumer groups to handle. Returns the request entry ids. A request Redis refused raises
    its error (:class:`DuplicateRequestError`, :class:`StreamRefusedError`) once the others are
    queued: :func:`send_each` reports each item instead."""
    outcomes = await send_each(settings, redis_client, requests, reply_to=reply_to)
    for outcome in outcomes:
        if isinstance(outcome, Exception):
            raise outcome
    return outcomes  # type: ignore[return-value]


async def send_each(
    settings: Settings,
    redis_client: Redis,
    requests: Iterable[GenerationRequest],
    *,
    reply_to: str | None = None,
) -> list[str | DuplicateRequestError | StreamRefusedError]:
    """:func:`send`, one outcome per request, in order: its entry id, or why it was not queued."""
    scripts = Scripts(redis_client, EventLog.from_settings(settings))
    tr, spans = tracer(), []  # (OpenTelemetry, when a tracer provider is set: shared/tracing.py)
    prepared = []
    for req in requests:
        part = settings.keys_for(req)
        target = reply_to or part.results
        if not part.is_reply_key(target):
            raise ValidationError("reply_to", f"{target!r} is not a result or reply stream of this request's "
                                              f"partition ({part.tag})")
        req.reply_to = target
        if tr is not None:
            spans.append(submit_span(tr, req))
        prepared.append((req, encode_request(req, settings.limits)))
    if settings.affinity_lanes:  # a producer with another L would queue on lanes nobody reads
        await agree_on_lanes(redis_client, settings.keys, settings.affinity_lanes)
    token_base = secrets.token_hex(8)
    items = [(req, fields["data"], f"send:{token_base}:{i}") for i, (req, fields) in enumerate(prepared)]
    replies = await submit_until_accepted(lambda chunk: submit_batch(redis_client, scripts, settings, chunk), items,
                                          "send")
    outcomes: list[str | DuplicateRequestError | StreamRefusedError] = []
    for (req, _), reply in zip(prepared, replies):
        try:
            outcomes.append(Scripts.submit_outcome(req.request_id, reply).entry_id)
        except (DuplicateRequestError, StreamRefusedError) as exc:
            outcomes.append(exc)
    for span in spans:
        end_span(span)
    return outcomes


async def submit_until_accepted(submit: Any, items: list, what: str) -> list:
    """``await submit(items)``; the items Redis refuses for a passing reason (out of memory, a
    read-only replica) are submitted again, with their own tokens, until it takes them: a submit
    waits, nothing is dropped (other refusals are the caller's, per item). One reply per item."""
    replies = await submit(items)
    delay, said = 0.2, False
    while True:
        waiting = [i for i, reply in enumerate(replies)
                   if int(reply[0]) == 3 and is_transient(text(reply[1]).partition(": ")[2])]
        if not waiting:
            if said:
                log.info("%s: Redis accepts submits again", what)
            return replies
        if not said:
            log.error("%s: Redis refuses %d submit(s) (%s); retrying until it accepts them", what, len(waiting),
                      text(replies[waiting[0]][1]))
            said = True
        await asyncio.sleep(delay)
        delay = min(delay * 2, 2.0)
        for i, reply in zip(waiting, await submit([items[i] for i in waiting])):
            replies[i] = reply


SUBMIT_CHUNK = 500
"""Requests per submit_many script call (a script blocks the server while it runs)."""


async def submit_batch(r: Redis, scripts: Scripts, settings: Settings,
                       items: list[tuple[GenerationRequest, bytes, str]]) -> list:
    """Submit (request, data, token) items with ``submit_many`` calls (one per request stream, in
    each request's partition) in one round trip; returns one [code, value] reply per item, in order
    (see :meth:`Scripts.submit_outcome`)."""
    groups: dict[tuple[str, Keys], list[int]] = {}
    for i, (req, _, _) in enumerate(items):
        part = settings.keys_for(req)
        groups.setdefault((request_stream(part, req), part), []).append(i)
    calls = [(stream, part, idx[j:j + SUBMIT_CHUNK]) for (stream, part), idx in groups.items()
             for j in range(0, len(idx), SUBMIT_CHUNK)]
    for attempt in (1, 2):
        async with r.pipeline(transaction=False) as pipe:
            for stream, part, idx in calls:
                scripts.submit_many_in(pipe, requests_key=stream, rid_ttl_s=settings.rid_ttl_s, items=[
                    (part.rid(items[i][0].request_id), items[i][2], items[i][0].request_id, items[i][0].reply_to,
                     items[i][1], items[i][0].lane_key if part.lanes else items[i][0].affinity_key) for i in idx])
            try:
                replies = raising_first_error(await pipe.execute(raise_on_error=False))
                break
            except redis.exceptions.NoScriptError:
                if attempt == 2:
                    raise
                await scripts.load_all()  # the server restarted and lost its script cache
    out: list = [None] * len(items)
    for (_, _, idx), reply in zip(calls, replies):
        for i, rep in zip(idx, reply):
            out[i] = rep
    return out
