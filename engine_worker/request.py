"""One request, top to bottom: decode, checks, engine, record, finish."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable

import msgspec

from redroll.engine_worker.checkpoints import (
    Checkpoint,
    Checkpoints,
    Saver,
    is_checkpointed,
    is_resumed,
    resume_request,
    starts_over,
    stitch_resumed,
)
from redroll.engine_worker.context import WorkerContext
from redroll.engine_worker.control import AbortedSet
from redroll.engine_worker.engines.base import EngineDeadError, EngineOutput, SampleOutput
from redroll.engine_worker.engines.grammar import is_structured, mark_continued
from redroll.engine_worker.flights import Flights, InFlight
from redroll.engine_worker.notice import DecodeRate
from redroll.engine_worker.outcomes import Outcomes
from redroll.engine_worker.records import build_record
from redroll.engine_worker.weights import WeightsGate
from redroll.observability.tracing import worker_spans
from redroll.shared.codec import NewerSchemaError, ValidationError, decode_request
from redroll.shared.keys import Keys, chunks_key_for
from redroll.shared.types import CompletionRecord, GenerationRequest, RecordStatus

log = logging.getLogger("redroll.worker")


BATCH_CHUNK = 32
"""Records of a batch published together (see :meth:`RequestRunner.handle_batch`)."""


class _AwaitWeights(Exception):
    """Raised inside a request's task to park it until the worker's weights are new enough."""


class RequestRunner:
    def __init__(self, ctx: WorkerContext, flights: Flights, outcomes: Outcomes, weights: WeightsGate,
                 aborted: AbortedSet):
        self.ctx = ctx
        self.flights = flights
        self.outcomes = outcomes
        self.weights = weights
        self.aborted = aborted
        self.checkpoints = Checkpoints(ctx)
        self.rate = DecodeRate()
        """The pace of this worker's generations (a notice judges by it what will finish here)."""
        self._batch_turn = asyncio.Lock()
        self._reply_keys_ok: set[tuple[str, str]] = set()
        """(partition tag, reply_to) pairs already checked to be this pipeline's streams."""

    async def handle(self, flight: InFlight, fields: dict) -> None:
        """The task of one in-flight entry: whatever happens, the entry leaves the worker (or is
        parked for new weights) and never hangs."""
        try:
            await self._process(flight, fields)
        except _AwaitWeights:
            self.flights.park(flight, fields)  # leased, not running: it starts again on new weights
        except asyncio.CancelledError:
            raise
        except ValidationError as exc:  # (the engine refused it while generating: served nowhere)
            await self.outcomes.dead_letter(flight, fields, exc.reason, error=exc, request=flight.request)
        except EngineDeadError as exc:
            await self._engine_died(flight, exc)
        except Exception as exc:
            await self._failed(flight, exc)
        finally:
            self.flights.done(flight)

    async def handle_batch(self, batch: list[tuple[InFlight, dict]]) -> None:
        """The task of the entries one claim started, with an engine that makes an output at once
        (``instant``): those that need nothing but the engine run here, without a task each. Any
        other entry (one that does not decode or is not served here, an aborted or expired one, one
        waiting for weights, a resumable one) gets a task of its own, as from :meth:`handle`."""
        inline: list[InFlight] = []
        settling: list[tuple[list, Awaitable[list[tuple[InFlight, Exception]]]]] = []
        try:
            async with self._batch_turn:
                await self._run_inline(batch, inline, settling)
        finally:
            for made, settle in settling:
                try:
                    failures = await settle
                except Exception as exc:
                    failures = [(flight, exc) for flight, _, _ in made]
                for flight, exc in failures:
                    await self._failed(flight, exc)
            for flight in inline:
                self.flights.done(flight)

    async def _run_inline(self, batch: list[tuple[InFlight, dict]], inline: list[InFlight],
                          settling: list[tuple[list, Awaitable[list[tuple[InFlight, Exception]]]]]) -> None:
        """Run ``batch`` (one batch at a time: ``_batch_turn``), its records queued for publishing
        :data:`BATCH_CHUNK` at a time, one publisher call each. After each chunk the task yields,
        so that chunk's records are sent, and the next claim goes out, while it runs the next one;
        with one batch running, each wait for the event loop is one chunk long."""
        made: list[tuple[InFlight, GenerationRequest, CompletionRecord]] = []
        for k, (flight, fields) in enumerate(batch, 1):
            try:
                request = self._runs_at_once(flight, fields)
            except Exception:  # (its own task meets it again, and handles it as any failure)
                request = None
            if request is None:
                self.flights.start(flight, fields)
            else:
                inline.append(flight)
                try:
                    record = self._generate_now(flight, request)
                except Exception as exc:
                    await self._failed(flight, exc)
                    record = None
                if record is not None:
                    made.append((flight, request, record))
            if made and (len(made) >= BATCH_CHUNK or k == len(batch)):
                try:
                    settling.append((made, self.outcomes.finish_many(made)))
                except Exception as exc:  # (a record that could not be queued)
                    settling.append((made, _raising(exc)))
                made = []
                await asyncio.sleep(0)

    def _runs_at_once(self, flight: InFlight, fields: dict) -> GenerationRequest | None:
        """The request of ``flight`` when it needs nothing but the engine, else None."""
        ctx = self.ctx
        if flight.deliveries > ctx.settings.max_deliveries or flight.stop_status is not None:
            return None
        try:
            request = self._decoded(flight, fields)
        except ValidationError:  # (decoded again in its own task, which says why)
            return None
        if (request in self.aborted or is_resumed(request) or flight.taken_back
                or (request.deadline is not None and request.deadline <= time.time())
                or (request.min_weight_version is not None and not self.weights.serves(request.min_weight_version))):
            return None
        flight.request = request
        return request

    def _generate_now(self, flight: InFlight, request: GenerationRequest) -> CompletionRecord | None:
        """Run ``request`` through the engine's immediate path: its record (None when the entry
        was handed back meanwhile). No deadline timer: nothing waits, so none could fire."""
        ctx = self.ctx
        queue_ms = max(0.0, (flight.claimed_at - request.submitted_at) * 1000.0)
        started = time.monotonic()
        output = ctx.engine.generate_now(request)  # type: ignore[attr-defined]
        engine_ms = (time.monotonic() - started) * 1000.0
        self.flights.release_slot(flight)
        if flight.handed_back:
            return None
        return self._record(flight, request, output, queue_ms, engine_ms)

    async def _engine_died(self, flight: InFlight, exc: EngineDeadError) -> None:
        """The engine can serve nothing any more: the worker stops at once and hands every entry it
        holds back, this one first, each marked as handed back on purpose (not a suspect of
        killing a worker, no error against the request)."""
        log.critical("engine died during request %s: %s; handing everything back and exiting",
                     flight.request.request_id if flight.request else "?", exc, extra=flight.context())
        self.ctx.engine_died(f"{type(exc).__name__}: {exc}")
        flight.handed_back = True
        await self.outcomes.hand_back_all([flight], f"handed back by {self.ctx.name} (its engine died)")

    async def _failed(self, flight: InFlight, exc: Exception) -> None:
        """An engine or Redis failure: the entry goes back to the fleet to be retried elsewhere
        (its error kept for whoever dead-letters it), never a hung request."""
        self.ctx.stats.engine_errors += 1
        rid = flight.request.request_id if flight.request else "?"
        log.error("request %s (entry %s) failed: %s", rid, flight.entry_id, exc, exc_info=exc,
                  extra=flight.context())
        await self.outcomes.record_error(flight, f"{self.ctx.name}: {type(exc).__name__}: {exc}"[:500])
        await self.outcomes.hand_back(flight)

    async def _process(self, flight: InFlight, fields: dict) -> None:
        ctx = self.ctx
        max_deliveries = ctx.settings.max_deliveries
        if flight.condemned is not None:
            # (it killed the worker that ran it alone: see Claimer._reclaim_halving)
            last = await self.outcomes.last_error(flight)
            reason = flight.condemned + (f"; last error: {last}" if last else "")
            await self.outcomes.dead_letter(flight, fields, reason, request=self._try_decode(fields))
            return
        if flight.deliveries > max_deliveries and not self._is_newer_schema(fields):
            # (a newer-schema entry keeps being handed back below: each reclaim counts as a
            # delivery, but it waits for a newer worker and is never dead-lettered for that)
            last = await self.outcomes.last_error(flight)
            reason = f"delivered {flight.deliveries} times (max_deliveries={max_deliveries})"
            if last:
                reason += f"; last error: {last}"
            await self.outcomes.dead_letter(flight, fields, reason, request=self._try_decode(fields))
            return
        try:
            request = self._decoded(flight, fields)
        except NewerSchemaError as exc:
            log.warning("entry %s: %s; handing it back for a newer worker", flight.entry_id, exc,
                        extra=flight.context())
            await self.checkpoints.discard(ctx.part_of[flight.stream], fields, flight.entry_id)
            # Noted as handed back on purpose: the next worker of this version takes it back with
            # the rest, not as a suspect of killing its worker (run alone, claiming paused).
            await self.outcomes.record_error(flight, f"{ctx.name}: handed back: {exc}"[:500])
            await self.outcomes.hand_back(flight)
            return
        except ValidationError as exc:
            # A request that decoded but is not servable here (model, vocabulary, reply_to) still
            # names its waiter: pass it on so that the waiter gets its error record.
            await self.outcomes.dead_letter(flight, fields, exc.reason, error=exc, request=flight.request)
            return
        queue_ms = max(0.0, (flight.claimed_at - request.submitted_at) * 1000.0)

        if flight.stop_status is None and request in self.aborted:
            flight.stop_status, flight.stop_reason = RecordStatus.ABORTED, "user"
        if flight.stop_status is None and request.deadline is not None and request.deadline <= time.time():
            flight.stop_status, flight.stop_reason = RecordStatus.EXPIRED, "deadline"
        if flight.stop_status is not None:
            await self.outcomes.finish(flight, request, self._not_started(flight, request, queue_ms))
            return

        if request.min_weight_version is not None and not self.weights.serves(request.min_weight_version):
            await self._wait_for_weights(flight, fields, request)
            return
        if request.deadline is not None:
            delay = max(0.0, request.deadline - time.time())
            flight.deadline_timer = asyncio.get_running_loop().call_later(
                delay, flight.stop, ctx.engine, RecordStatus.EXPIRED, "deadline")
        started = time.monotonic()
        resume = saver = None
        why = starts_over(request, ctx.settings, ctx.tokenizer, grammar_resume=ctx.capabilities.grammar_resume)
        if why is None:
            if flight.taken_back:  # (a first delivery has no checkpoint)
                resume = await self.checkpoints.load(ctx.part_of[flight.stream], request, flight.entry_id)
                resume = await self._grammar_allows(flight, request, resume)
            if resume is not None:
                flight.checkpointed = True
                ctx.stats.resumed += 1
                log.info("request %s: continuing after %d saved token(s)", request.request_id, resume.tokens,
                         extra=flight.context())
            # (saved while it runs, or only what a drain or a notice cuts short)
            saver = self.checkpoints.saver(flight, request, resume, periodic=is_checkpointed(request, ctx.settings))
        elif flight.taken_back:
            log.info("request %s starts over: %s", request.request_id, why, extra=flight.context())
        output = await self._generate(flight, request, resume, saver)
        engine_ms = (time.monotonic() - started) * 1000.0
        self.flights.release_slot(flight)
        if not output.aborted and output.samples and flight.generation_started is not None:
            self.rate.observe(max(len(x.token_ids) for x in output.samples), time.monotonic() - flight.generation_started)
        if flight.handed_back:
            # drained: the entry goes back to the fleet; a resumable one keeps what was made
            if ctx.tracer is not None:
                worker_spans(ctx.tracer, request, None, worker=ctx.name, entry_id=flight.entry_id,
                             deliveries=flight.deliveries, claimed_at=flight.claimed_at, engine_ms=engine_ms)
            if saver is not None and output.samples:
                await saver.flush(output.samples[0])
            return
        if resume is not None:
            output = stitch_resumed(resume, output, request, ctx.name, ctx.tokenizer)
        await self.outcomes.finish(flight, request, self._record(flight, request, output, queue_ms, engine_ms))

    def _record(self, flight: InFlight, request: GenerationRequest, output: EngineOutput, queue_ms: float,
                engine_ms: float) -> CompletionRecord:
        """The record of a generation that ran. Labelled by what happened: one that ended on its
        own (stop, length) just as its abort or deadline arrived is finished, not aborted."""
        ctx = self.ctx
        status = (flight.stop_status or RecordStatus.ABORTED) if output.aborted else RecordStatus.FINISHED
        record = build_record(request, output, status=status, worker=ctx.name, info=ctx.engine.info,
                              attempt=flight.attempt, queue_ms=queue_ms, engine_ms=engine_ms)
        if ctx.tracer is not None:
            flight.span = worker_spans(ctx.tracer, request, record, worker=ctx.name, entry_id=flight.entry_id,
                                       deliveries=flight.deliveries, claimed_at=flight.claimed_at, engine_ms=engine_ms)
        if status is not RecordStatus.FINISHED:
            record.meta_info["abort_reason"] = flight.stop_reason or "engine"
        ctx.stats.tokens += record.meta_info.get("completion_tokens", 0)
        return record

    async def _generate(self, flight: InFlight, request: GenerationRequest, resume: Checkpoint | None,
                        saver: Saver | None) -> EngineOutput:
        """The engine's output for ``request``, continued after ``resume`` when there is one, with
        ``saver`` checkpointing meanwhile."""
        ctx = self.ctx
        if resume is not None and (resume.finish_reason is not None
                                   or resume.tokens >= request.sampling_params.max_new_tokens):
            # It had finished when its worker died: nothing left to generate.
            return EngineOutput(samples=[SampleOutput([], [], resume.finish_reason or "length")],
                                prompt_tokens=len(request.input_ids or []),
                                weight_version=ctx.engine.info.weight_version)
        if flight.stop_status is not None or flight.handed_back:
            # Aborted, expired or drained while its checkpoint loaded: the engine ignored that abort
            # (of a handle it did not know yet), so the generation never starts.
            return EngineOutput(samples=[SampleOutput([], [] if request.return_logprob else None, "abort")],
                                prompt_tokens=len(request.input_ids or []),
                                weight_version=ctx.engine.info.weight_version)
        generating = (mark_continued(resume_request(request, resume, ctx.tokenizer, ctx.engine.info.name), request,
                                     resume.tokens) if resume is not None else request)
        if saver is not None and saver.periodic and not generating.resumable:
            # (the engine shows partial output of the requests that ask to be saved: see PartialOutput)
            generating = msgspec.structs.replace(generating, resumable=True)
        flight.generation_started = time.monotonic()
        flight.generation_budget = generating.sampling_params.max_new_tokens
        if saver is not None:
            saver.start()
        try:
            return await ctx.engine.generate(generating, flight.handle)
        finally:
            if saver is not None:
                await saver.stop()

    async def _grammar_allows(self, flight: InFlight, request: GenerationRequest,
                              resume: Checkpoint | None) -> Checkpoint | None:
        """The checkpoint ``request`` continues from. A structured one (a grammar or a constraining
        tool choice) continues only on an engine that advances its grammar over the saved tokens
        (``grammar_resume``: the continuation is marked, see :meth:`_generate`). On any other (vLLM:
        no grammar can be started mid-output) its checkpoint is deleted and it starts over from its
        prompt, under its whole grammar; a streamed one cannot (its reader holds the saved tokens),
        so it is refused naming ``stream``."""
        if resume is None or not resume.tokens or self.ctx.capabilities.grammar_resume or not is_structured(request):
            return resume
        engine = self.ctx.engine.info.name
        if request.stream:
            raise ValidationError("stream", f"a streamed structured request cannot go on after {resume.tokens} "
                                            f"token(s) on the {engine} engine (it cannot take its grammar up "
                                            "mid-output, and its reader has those tokens): send it again")
        log.info("request %s: starting over (the %s engine cannot take a grammar up after %d saved token(s))",
                 request.request_id, engine, resume.tokens, extra=flight.context())
        await self.checkpoints.discard(self.ctx.part_of[flight.stream], {"rid": request.request_id}, flight.entry_id)
        return None

    def _not_started(self, flight: InFlight, request: GenerationRequest, queue_ms: float) -> CompletionRecord:
        """The record of a request stopped before it reached the engine (aborted, expired)."""
        status = flight.stop_status
        return CompletionRecord.failed(
            request, request_id=request.request_id, status=status,  # type: ignore[arg-type]
            error=None if status is RecordStatus.ABORTED else "deadline passed before start",
            worker=self.ctx.name, n=request.n,
            meta_info={"worker": self.ctx.name, "attempt": flight.attempt, "queue_ms": round(queue_ms, 3),
                       "weight_version": self.ctx.engine.info.weight_version, "abort_reason": flight.stop_reason})

    async def _wait_for_weights(self, flight: InFlight, fields: dict, request: GenerationRequest) -> None:
        """A request for newer weights than this worker has: wait for them if the pipeline's desired
        weights are new enough (an update is on its way), else dead-letter it."""
        desired = await self.weights.desired_version()
        if desired is not None and desired >= request.min_weight_version:  # type: ignore[operator]
            log.info("request %s needs weight_version >= %s (have %s): waiting for the update",
                     request.request_id, request.min_weight_version, self.ctx.engine.info.weight_version,
                     extra=flight.context())
            raise _AwaitWeights()
        reason = (f"min_weight_version {request.min_weight_version} is newer than the pipeline's desired "
                  f"weights ({desired if desired is not None else 'none set'})")
        await self.outcomes.dead_letter(flight, fields, reason, request=request)

    def _decoded(self, flight: InFlight, fields: dict) -> GenerationRequest:
        """The entry's request, decoded and checked (served here, then the engine's own checks);
        :class:`ValidationError` (or :class:`NewerSchemaError`) naming the field otherwise.
        ``flight.request`` is set as soon as it decodes (its waiter is then known)."""
        request = decode_request(fields, self.ctx.settings.limits)
        flight.request = request
        self._check_served(request, self.ctx.part_of[flight.stream])
        self.ctx.engine.validate(request)
        return request

    def _check_served(self, request: GenerationRequest, part: Keys) -> None:
        reply_to = request.reply_to
        if reply_to is not None and (part.tag, reply_to) not in self._reply_keys_ok:
            if not part.is_reply_key(reply_to):
                raise ValidationError("reply_to", f"{request.reply_to!r} is not a result or reply stream of this pipeline")
            if len(self._reply_keys_ok) > 10_000:
                self._reply_keys_ok.clear()
            self._reply_keys_ok.add((part.tag, reply_to))
        if request.stream and (reply_to is None or chunks_key_for(reply_to) is None):
            raise ValidationError("stream", f"a streamed request replies to a producer's reply stream, not {reply_to!r}")
        if request.stream and not self.ctx.capabilities.partial_output:
            raise ValidationError("stream", f"the {self.ctx.engine.info.name} engine shows no partial output "
                                            "(the partial_output capability): it cannot stream")
        model = self.ctx.engine.info.model
        if request.model is not None and request.model != model:
            raise ValidationError("model", f"{request.model!r} is not served here (this pipeline serves {model!r})")

    def abort_matching(self, request_ids: set[str], group_ids: set[str]) -> None:
        """Stop every in-flight request named by id or group (parked ones re-check at once:
        aborted ones publish now, others park again)."""
        for flight in self.flights:
            req = flight.request
            if req is not None and (req.request_id in request_ids or (req.group_id is not None
                                                                        and req.group_id in group_ids)):
                log.info("request %s: abort", req.request_id, extra=flight.context())
                flight.stop(self.ctx.engine, RecordStatus.ABORTED)
        if self.flights.parked:
            self.flights.resume_parked()

    def _is_newer_schema(self, fields: dict) -> bool:
        try:
            decode_request(fields, self.ctx.settings.limits)
        except NewerSchemaError:
            return True
        except ValidationError:
            pass
        return False

    def _try_decode(self, fields: dict) -> GenerationRequest | None:
        try:
            return decode_request(fields, self.ctx.settings.limits)
        except ValidationError:
            return None


async def _raising(exc: Exception) -> list:
    raise exc
