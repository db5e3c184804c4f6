"""The async producer client: submit requests, await or call back on their records.

A producer reads its own reply stream ``{ns}:reply:<name>`` through consumer group
``producer`` (consumer ``<name>``), so two producers never take each other's results, and a
restarted producer with the same name finds the records it had not yet handled.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import uuid
import warnings
from operator import attrgetter
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterable, Mapping, TypeVar

import msgspec
import redis
from redis.asyncio import Redis

from redroll.observability.tracing import end_span, submit_span, tracer
from redroll.ops.control import abort_requests
from redroll.ops.control import update_weights as _update_weights
from redroll.producer import dead_notices
from redroll.producer.admission import Admission
from redroll.producer.pending import Callback, PendingRequests
from redroll.producer.replies import BeforeAckError, ReplyReader
from redroll.producer.request import make_request, request_stream
from redroll.producer.rollout import RolloutGroup, group_members, next_segment, stitch_segments
from redroll.producer.sending import SUBMIT_CHUNK, send, send_each, submit_batch, submit_until_accepted
from redroll.producer.stream_reader import ChunkReads, StreamChunk, stream_chunks
from redroll.shared.codec import check_request_id, encode_request
from redroll.shared.connection import connect, open_connections, reach, read_groups
from redroll.shared.events import EventLog
from redroll.shared.keys import PRODUCER_GROUP, Keys, chunks_key_for
from redroll.shared.lanes import agree_on_lanes
from redroll.shared.refusals import StreamRefusedError
from redroll.shared.scripts import DuplicateRequestError, Scripts
from redroll.shared.settings import Settings
from redroll.shared.streams import ensure_group, unique_consumer_name
from redroll.shared.types import CompletionRecord, GenerationRequest, RecordStatus

if TYPE_CHECKING:
    from redroll.producer.keyed import KeyedCalls
    from redroll.producer.session import Session

__all__ = ["SUBMIT_CHUNK", "BeforeAckError", "Callback", "Producer", "StreamChunk", "make_request", "request_stream", "send",
           "send_each", "submit_batch", "submit_until_accepted"]

log = logging.getLogger("redroll.producer")


_warned_renames: set[str] = set()
"""The deprecated names this process was already warned about (each warns once)."""


def warn_renamed(old: str, new: str) -> None:
    """A DeprecationWarning, the first time in this process, that ``Producer.old`` is now ``Producer.new``."""
    if old in _warned_renames:
        return
    _warned_renames.add(old)
    warnings.warn(f"Producer.{old} is renamed Producer.{new}; the old name will be removed in a later release",
                  DeprecationWarning, stacklevel=3)


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


_T = TypeVar("_T")


def _started(part: _T | None) -> _T:
    """``part`` of a started producer (its client, its reply reader); before the start, an error
    saying how to start it."""
    if part is None:
        raise RuntimeError("producer not started: use 'async with Producer(...)' or 'await start()'")
    return part


class Producer:
    """Submit generation requests and receive their records.

    Use as ``async with Producer(settings) as p: rec = await (await p.submit(prompt="hi"))``.

    Its parts, one job each: :class:`~.pending.PendingRequests` owns the requests between submit
    and record, :class:`~.replies.ReplyReader` reads the reply streams into it,
    :class:`~.admission.Admission` holds submits back for room, :mod:`.sending` sends.
    """

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
        :meth:`unclaimed` until then), and is not sent again: the finish leaves a mark naming the
        token until the record is acked, so this holds even when the record comes in between this
        producer's reads and its submit. That is how ``redroll submit --resume`` takes over an
        interrupted run.

        ``before_ack()`` runs before the reply entries of applied records are acked, after their
        callbacks: where what the callbacks did is made to last (a file flushed), so that a process
        killed at any instant leaves each record either applied or still on its reply stream. While
        it raises, those entries stay unacked (:class:`BeforeAckError`, logged by the reader, which
        reads them again and tries again later; their callbacks do not run again)."""
        self.admission = Admission(max_inflight, max_staleness, batch_size)
        self.pending = PendingRequests(on_given_back=self.admission.give_back)
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
        self._reader: ReplyReader | None = None
        self._readers: list[asyncio.Task] = []
        self._closed = False
        self._tokens_from_ids = tokens_from_ids
        self._before_ack = before_ack
        self._stream_redis: Redis | None = None

    # ------------------------------------------------------------------ lifecycle

    weight_version = property(attrgetter("admission.weight_version"), doc="The trainer's weight version, as "
                              ":meth:`set_weight_version` or :meth:`update_weights` set it.")
    admitted = property(attrgetter("admission.admitted"), doc="Requests admitted under the staleness bound (see "
                        ":class:`~.admission.Admission`).")

    @property
    def redis(self) -> Redis:
        return _started(self._redis)

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
        self._reader = reader = ReplyReader(
            redis_client=self._redis, scripts=self.scripts, settings=self.settings, name=self.name,
            reply_streams=self.reply_streams, parts=self.parts, pending=self.pending, read_count=self.read_count,
            block_ms=self.block_ms, before_ack=self._before_ack,
            after_ack=self.admission.notify if self.admission.bounded else None)
        groups = read_groups(self._redis, self.reply_streams)  # one reader per group
        for g in groups:
            await reader.read_what_came(g)
        self._readers = [asyncio.create_task(reader.read_loop(g), name=f"producer-reader-{self.name}-{i}")
                         for i, g in enumerate(groups)]
        for i, g in enumerate(read_groups(self._redis, [part.dead for part in self.parts])):
            positions = await dead_notices.start_positions(self._redis, g)
            self._readers.append(asyncio.create_task(dead_notices.watch(
                self._redis, positions, set(self.reply_streams), reader.resolve_notice, block_ms=self.block_ms,
                closed=lambda: self._closed), name=f"producer-dead-watch-{self.name}-{i}"))
        return self

    @property
    def reader(self) -> ReplyReader:
        return _started(self._reader)

    async def close(self) -> None:
        self._closed = True
        if self._reader is not None:
            self._reader.closed = True
        self.pending.wake()
        await self.admission.close()
        for reader in self._readers:
            reader.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        self.pending.cancel_all()
        if self._owns_redis and self._redis is not None:
            await self._redis.aclose()
        if self._stream_redis is not None:
            await self._stream_redis.aclose()

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
        if not self.admission.bounded:
            return await self._submit_chunk(items, callback, validated)
        futures: list[asyncio.Future] = []
        step = self.admission.max_inflight or len(items) or 1
        i = 0
        while i < len(items):
            room = await self.admission.wait_for_room(lambda: len(self.pending))
            chunk = items[i:i + min(step, room)]
            futures += await self._submit_chunk(chunk, callback, validated)
            i += len(chunk)
        return futures

    def set_weight_version(self, version: int) -> None:
        """The trainer's current weight version (for the staleness bound)."""
        self.admission.set_weight_version(version)

    async def _submit_chunk(self, requests: list, callback: Callback | None,
                            validated: bool = False) -> list[asyncio.Future]:
        prepared: list[tuple[GenerationRequest, dict[str, bytes], str]] = []
        token_base = f"{self.name}:{secrets.token_hex(8)}"  # (one random part per chunk, then its index)
        spans = []  # (OpenTelemetry, when a tracer provider is set: redroll/observability/tracing.py)
        for i, item in enumerate(requests):
            req = item if isinstance(item, GenerationRequest) else make_request(**dict(item))
            req.reply_to = self.settings.keys_for(req).reply(self.name)
            if self._tracer is not None:
                spans.append(submit_span(self._tracer, req))
            fields = encode_request(req, self.settings.limits, check=not validated)
            # (neither a name nor a request_id holds whitespace, which ends a token in the rid key)
            token = f"{self.name}:{req.request_id}" if self._tokens_from_ids else f"{token_base}:{i}"
            prepared.append((req, fields, token))
        for req, _, _ in prepared:
            if req.request_id in self.pending:
                raise DuplicateRequestError(req.request_id)
        futures = [self.pending.expect(req.request_id, callback).future for req, _, _ in prepared]
        self.admission.admit(len(prepared))
        came = await self._resolve_held(prepared) if self._tokens_from_ids and self.pending.held else set()
        # (and under tokens_from_ids, one whose record the reader handed its new waiter meanwhile: its
        # earlier submit finished, and sending it again would generate it again)
        sending = [(item, fut) for item, fut in zip(prepared, futures)
                   if item[0].request_id not in came and not (self._tokens_from_ids and fut.done())]
        submitting = {req.request_id for (req, _, _), _fut in sending}
        self.pending.begin_submit(submitting)
        try:
            replies = await self._submit_until_accepted([item for item, _ in sending]) if sending else []
        except BaseException:
            for (req, _, _), _fut in sending:
                self.pending.forget(req.request_id)
            self.admission.give_back(len(sending))
            raise
        finally:  # (after a failed submit they stay pending: the reader finds them, and acks them)
            came_meanwhile = self.pending.end_submit(submitting)
        await self.reader.ack_now(came_meanwhile)
        failed: Exception | None = None
        for ((req, _, _), fut), reply in zip(sending, replies):
            try:
                Scripts.submit_outcome(req.request_id, reply)
            except (DuplicateRequestError, StreamRefusedError) as exc:
                self.pending.forget(req.request_id)
                self.admission.give_back(1)
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
        held = {req.request_id: self.pending.held.pop(req.request_id) for req, _, _ in prepared
                if req.request_id in self.pending.held}
        await self.reader.ack_now([(entry_id, record.request_id) for entry_id, record in held.values()
                                   if await self.pending.resolve(record, entry_id)])
        return set(held)

    async def _submit_until_accepted(self, prepared: list) -> list:
        return await submit_until_accepted(lambda items: self._submit_with_retry(items), prepared,
                                           f"producer {self.name}")

    async def _submit_with_retry(self, prepared: list, attempts: int = 8) -> list:
        """Send the submit scripts; a retry after a dropped connection (or a ClusterError: a cluster client
        gave up mid-resharding) reuses each token, so a request already taken is reported, not refused."""
        delay = 0.1
        for attempt in range(attempts):
            try:
                return await submit_batch(self.redis, self.scripts, self.settings,
                                          [(req, fields["data"], token) for req, fields, token in prepared])
            except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterError, OSError) as exc:
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
        pending = self.pending.waiting.get(request_id)
        if pending is None and request_id in self.pending.recent:
            if not fresh:
                raise LookupError(f"the record of {request_id!r} was already delivered by this producer")
            later = self.pending.recent.pop(request_id)[1]
            if later is not None:
                return later  # a newer record of this id arrived before this call
        if pending is None:
            held = self.pending.take_held(request_id)
            if held is not None:
                await self.reader.ack([(held[0], request_id)])
                return held[1]
            pending = self.pending.expect(request_id)
        return await asyncio.wait_for(asyncio.shield(pending.future), timeout)

    async def as_completed(self, futures: Iterable[asyncio.Future]) -> AsyncIterator[CompletionRecord]:
        """Yield records in the order they complete."""
        for fut in asyncio.as_completed(list(futures)):
            yield await fut

    async def unclaimed(self) -> AsyncIterator[CompletionRecord]:
        """Records nobody in this process waits for (e.g. submitted before a restart), as they arrive."""
        while not self._closed:
            while (held := self.pending.take_held()) is not None:
                entry_id, rec = held
                await self.reader.ack([(entry_id, rec.request_id)])
                yield rec
            await self.pending.wait_for_held()

    @property
    def outstanding(self) -> int:
        """Requests submitted here whose record has not arrived yet."""
        return len(self.pending)

    async def abort(self, request_ids: Iterable[str] = (), *, group_id: str | None = None) -> list[str]:
        """Abort by request_id or group_id: queued ones first, each cancelled in the queue at once
        (atomically: its aborted record is published and its entry deleted, unless a worker took
        it meanwhile); then the rest is aborted in flight by its worker. (In that order: an
        in-flight abort frees slots, and workers would claim the queued ones next.) Returns the
        request_ids cancelled while still queued; their request_ids stay held (a submit of one is
        refused as a duplicate) until housekeeping releases them (``redroll gc``, the workers'
        about once per ``gc_interval_s``)."""
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
        from redroll.producer.session import Session

        return Session(self, key) if key else Session(self)

    async def generate_across_updates(self, request: GenerationRequest | None = None, *, max_segments: int = 16,
                                      **fields: Any) -> CompletionRecord:
        """Generate one sample that survives weight updates with ``abort_inflight``: each time one
        cuts it short, submit the rest as a new segment (prompt + tokens so far, the remaining
        budget, the same seed), then stitch the segments (ids, logprobs, per-segment weight
        versions) into one record. (A dead worker is survived by the request flag ``resumable``
        instead, which the workers handle: see :mod:`redroll.shared.continuing`.)"""
        original = request or make_request(**fields)
        if original.n != 1:
            raise ValueError("generate_across_updates is single-sample; use submit_group for n samples")
        original = msgspec.structs.replace(original, collect_unfinished=True)
        segments: list[CompletionRecord] = []
        current: GenerationRequest | None = original
        while current is not None and len(segments) < max_segments:
            rec = await (await self.submit(current))
            segments.append(rec)
            if rec.status is not RecordStatus.ABORTED or rec.meta_info.get("abort_reason") != "weight_update":
                break
            so_far = [t for seg in segments for t in seg.output_token_ids[0]]
            current = next_segment(original, so_far, len(segments))
        return stitch_segments(original.request_id, segments)

    async def stream(self, request: GenerationRequest | None = None, *, timeout: float | None = None,
                     **fields: Any) -> AsyncIterator[StreamChunk]:
        """Submit one request with ``stream`` and yield its output while it generates:
        ``async for chunk in producer.stream(prompt="Hi", sampling_params={"max_new_tokens": 64})``.
        Each :class:`~redroll.producer.stream_reader.StreamChunk` carries the token offset it starts at,
        its token ids, text and logprobs; the last has the finish reason and the record. A worker
        that dies mid-stream costs nothing: another continues after what was sent. ``timeout`` (s):
        the whole stream's, raising :class:`TimeoutError` (the request goes on: :meth:`result` or
        :meth:`abort` it)."""
        req = request or make_request(**fields)
        if not req.stream:
            req = msgspec.structs.replace(req, stream=True)
        since = (await self.chunk_marks([req]))[0]  # (before its submit: every chunk of it comes after)
        future = await self.submit(req)  # (sets req.reply_to)
        chunks = stream_chunks(self._stream_reads(), req, future, since)
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        try:
            while True:
                left = None if deadline is None else deadline - asyncio.get_running_loop().time()
                if left is not None and left <= 0:
                    raise TimeoutError(f"request {req.request_id!r} did not finish streaming within {timeout} s")
                try:
                    chunk = await asyncio.wait_for(chunks.__anext__(), left)
                except StopAsyncIteration:
                    return
                yield chunk
        finally:
            await chunks.aclose()

    async def chunk_marks(self, requests: list[GenerationRequest], reader: Redis | None = None) -> list[str]:
        """For each of ``requests`` about to be submitted by this producer, a place in its chunk
        stream before its first chunk (:meth:`ChunkReads.mark` of ``reader``, the client that will
        read it: this producer's stream reads by default): where :func:`stream_chunks` starts."""
        client = reader or self._stream_reads()
        marks: dict[str, str] = {}
        out = []
        for req in requests:
            key = str(chunks_key_for(self.settings.keys_for(req).reply(self.name)))
            if key not in marks:
                marks[key] = await ChunkReads.of(client, key).mark(key)
            out.append(marks[key])
        return out

    def _stream_reads(self) -> Redis:
        """The client whose connections streams' blocking reads hold (the submit pool stays free)."""
        if self._stream_redis is None:
            self._stream_redis = connect(self.settings, max_connections=1024)
        return self._stream_redis

    async def generate_resumable(self, request: GenerationRequest | None = None, *, max_segments: int = 16,
                                 **fields: Any) -> CompletionRecord:
        """Deprecated: the old name of :meth:`generate_across_updates` (warns once per process)."""
        warn_renamed("generate_resumable", "generate_across_updates")
        return await self.generate_across_updates(request, max_segments=max_segments, **fields)

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

    def keyed_calls(self, wait_client: Redis, window_s: int) -> "KeyedCalls":
        """Calls whose records stay readable by any process for ``window_s`` (see
        :mod:`redroll.producer.keyed`), submitted on this producer's connection, awaited on
        ``wait_client``."""
        from redroll.producer.keyed import KeyedCalls

        return KeyedCalls(self.settings, self.redis, self.scripts, wait_client, window_s)

    def weight_sync(self, **options: Any) -> Any:
        """Push a trainer's weights to the fleet over torch.distributed (see
        :class:`redroll.producer.weight_sync.WeightSync` for the options)::

            async with producer.weight_sync(backend="gloo") as sync:
                await sync.push(model.named_parameters(), version="12")
        """
        from redroll.producer.weight_sync import WeightSync  # (torch is needed only for this)

        return WeightSync(self, **options)
