"""Checkpoints: a request's partial output saved while it generates, continued elsewhere.

A request that continues after a hand-back or a death (:func:`starts_over` says which: any
single-sample one without a grammar, ... under the worker's ``continuation`` setting; a streamed or
``resumable`` one always) has its partial output saved next to it, under its hash tag, in
``{tag}:partial:<request_id>``: every ``checkpoint_tokens`` new tokens and ``checkpoint_interval_s``
seconds, whichever comes later (from ``checkpoint_min_new_tokens`` on). A delivery's first save,
one every :data:`~.checkpoint_writes.CONSOLIDATE_S` after it and a flush before a hand-back
*consolidate*: one fenced append to the checkpoint (``checkpoint_many.lua``) of the parts saved
since the last one and the save's own; every other save is a part only, one field of the worker's
parts stream (all the saves of the worker's tick go in one round trip: see :mod:`.checkpoint_writes`;
reading both back: :mod:`redroll.shared.checkpoint_reads`). Only the lease owner writes the
checkpoint, and it names the entry it belongs to, so a requeue or a resubmit never resumes a
stale one. A request with stop strings is
saved only as far as its text is settled (:mod:`.settled_text`), so a continuation sees every stop
string whole. A worker given notice saves what the engine made before handing the entry back
(:mod:`.notice`). The fenced finish, dead-lettering, a newer-schema hand-back and GC delete it.

A streamed request (``stream``: any prompt, one sample) is checkpointed the same way, more often:
every ``stream_chunk_tokens`` tokens or ``stream_chunk_ms`` ms, whichever comes first, and only
as far as its text is settled. Each part is also the request's next chunk, added to its chunk
stream in the same fenced call as the part (``save_parts.lua``, or the consolidating append):
what a reader was sent is what was saved, so a continuation on another
worker (greedy or sampled) goes on after exactly what the reader has.

A worker that takes the entry again (a reclaim after a death, a hand-back) continues from prompt
(a text encoded, a chat rendered: :func:`prompt_ids`) + saved tokens with the remaining budget and
publishes one stitched record: ids, logprobs, top logprobs, per-token ``weight_versions`` and
``meta_info.segments`` (which worker and version made which part). It samples from the
distribution the uninterrupted run would have had there, not the same bytes: a seeded request
continues with ``sampling_seed + tokens saved``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec
import redis

from redroll.engine_worker.checkpoint_writes import CONSOLIDATE_S, SLOW_SAVE_S, CheckpointWriter, Prepared
from redroll.engine_worker.context import WorkerContext
from redroll.engine_worker.engines.base import EngineOutput, SampleOutput
from redroll.engine_worker.engines.text import render_chat, sample_text
from redroll.engine_worker.settled_text import settled
from redroll.shared.checkpoint_reads import (  # noqa: F401 (parse_checkpoint: re-exported)
    HEADER_BYTES,
    Checkpoint,
    load_checkpoint,
    parse_checkpoint,
)
from redroll.shared.checkpoint_saves import CheckpointSave, PartSave
from redroll.shared.chunks import Part, encode_part
from redroll.shared.codec import ValidationError
from redroll.shared.continuing import continue_after, join_parts
from redroll.shared.keys import Keys, chunks_key_for, owner_key_for
from redroll.shared.types import GenerationRequest

log = logging.getLogger("redroll.worker")

GRAMMAR_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")
"""The sampling keys that constrain the output to a grammar (the gateway's ``structured_outputs``
arrive as these)."""


def starts_over(request: GenerationRequest, settings: Any, tokenizer: Any, *,
                grammar_resume: bool = False) -> str | None:
    """Why ``request``, handed back or taken from a dead worker, starts over from token 0; None
    when it continues from its saved tokens (see docs/spot.md). A streamed or ``resumable`` request
    always continues (a reader has its tokens, or its submitter asked for it); any other does under
    ``settings.continuation`` when continuing samples from the distribution it would have (a
    grammar only on an engine that takes it up over the saved tokens: ``grammar_resume``):"""
    if request.stream or request.resumable:
        return None
    if not settings.continuation:
        return "continuation is off"
    sp = request.sampling_params
    if sp.n != 1:
        return "n > 1: its samples are made together, and start over together"
    grammar = [key for key in GRAMMAR_KEYS if getattr(sp, key) is not None]
    if grammar and not grammar_resume:
        return f"sampling_params.{grammar[0]}: this engine cannot take a grammar up in the middle of an output"
    if sp.stop_regex is not None:
        return "sampling_params.stop_regex: a match may straddle the saved tokens"
    if sp.frequency_penalty or sp.presence_penalty:
        return "frequency or presence penalty: it counts the output's tokens, and saved ones would count as prompt"
    if sp.custom_params is not None:
        return "sampling_params.custom_params: a custom logit processor may depend on the whole output"
    if request.logprob_start_len is not None:
        return "logprob_start_len: the prompt's logprobs would run into the saved tokens"
    if request.return_routed_experts:
        return "return_routed_experts: the saved tokens' routing is not kept"
    if request.input_ids is None and tokenizer is None:
        return "a text or chat prompt, on an engine without a tokenizer to render it as token ids"
    return None


def is_checkpointed(request: GenerationRequest, settings: Any) -> bool:
    """Whether ``request`` (one that continues: :func:`starts_over`) is saved while it runs, not
    only when a drain or a notice hands it back: a streamed one always, any other from
    ``checkpoint_min_new_tokens`` new tokens on."""
    return request.stream or request.sampling_params.max_new_tokens >= settings.checkpoint_min_new_tokens


def is_resumed(request: GenerationRequest) -> bool:
    """Whether the request itself asks to continue after a hand-back or a death (``stream`` or
    ``resumable``; others do by the worker's ``continuation`` setting: :func:`starts_over`)."""
    return request.resumable or request.stream


def prompt_ids(request: GenerationRequest, tokenizer: Any, engine: str = "this") -> list[int]:
    """The prompt's token ids as the engine makes them: ``input_ids``, a chat rendered by the chat
    template, a text prompt encoded by the tokenizer (the engine's :class:`~.engines.base.Tokenizer`).
    A text or chat prompt on an engine without a tokenizer is refused, naming the field: its
    continuation cannot be rendered (never continued from an empty prompt)."""
    if request.input_ids is not None:
        return list(request.input_ids)
    field = "messages" if request.messages is not None else "prompt"
    if tokenizer is None:
        raise ValidationError(field, f"the {engine} engine has no tokenizer to continue it after a checkpoint: "
                                     "send input_ids")
    if request.messages is not None:
        return render_chat(tokenizer, request, engine)
    return [int(t) for t in tokenizer.encode(request.prompt or "")]


def resume_request(request: GenerationRequest, cp: Checkpoint, tokenizer: Any = None,
                   engine: str = "this") -> GenerationRequest:
    """``request`` continued after the checkpoint's tokens (see :func:`~redroll.shared.continuing.continue_after`):
    the prompt grows by them and the budget shrinks by as much; a seeded request continues with
    ``sampling_seed + tokens saved``. A text or chat prompt becomes its token ids first (``tokenizer``:
    the engine's, see :func:`prompt_ids`), the record's text still wanted as before."""
    seed = request.sampling_params.sampling_seed
    fields: dict[str, Any] = {}
    if request.input_ids is None:
        fields = {"prompt": None, "messages": None, "tools": None, "chat_template": None,
                  "chat_template_kwargs": None, "return_text": request.wants_text}
        request = msgspec.structs.replace(request, input_ids=prompt_ids(request, tokenizer, engine))
    return continue_after(request, cp.token_ids, seed=None if seed is None else seed + cp.tokens, **fields)


def stitch_resumed(cp: Checkpoint, output: EngineOutput, request: GenerationRequest, worker: str,
                   tokenizer: Any = None) -> EngineOutput:
    """One output from the saved part and what this worker made after it (joined as
    :func:`~redroll.shared.continuing.join_parts` says); its text decoded from the joined ids."""
    new = output.samples[0]
    version = output.weight_version
    new_versions = list(new.weight_versions) if new.weight_versions else [str(version)] * len(new.token_ids)
    joined = join_parts([(cp.token_ids, cp.logprobs, cp.weight_versions),
                         (new.token_ids, None if new.logprobs is None else list(new.logprobs), new_versions)])
    tops = None
    if request.top_logprobs_num and cp.top_logprobs is not None and new.top_logprobs is not None:
        tops = [*cp.top_logprobs, *new.top_logprobs]
    sample = SampleOutput(token_ids=joined.token_ids, logprobs=joined.logprobs, finish_reason=new.finish_reason,
                          weight_versions=joined.weight_versions, top_logprobs=tops)
    if request.wants_text and tokenizer is not None:
        sample.text = sample_text(tokenizer, sample.token_ids, request.sampling_params, sample.finish_reason)
    segments = [*cp.segments, {"worker": worker, "weight_version": version, "tokens": len(new.token_ids)}]
    extra = dict(output.extra)
    extra.update(segments=segments, resumed_from=cp.tokens)
    prompt = output.prompt_token_ids  # (the engine ran prompt + saved tokens: the prompt is what comes before)
    return EngineOutput(samples=[sample], prompt_tokens=max(0, output.prompt_tokens - cp.tokens),
                        cached_tokens=output.cached_tokens, weight_version=version, extra=extra,
                        prompt_token_ids=prompt[:len(prompt) - cp.tokens] if prompt is not None else None)


class Checkpoints:
    """Loading checkpoints, and the savers of one worker (written by its :class:`~.checkpoint_writes.CheckpointWriter`)."""

    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self.writer = CheckpointWriter(ctx)

    async def load(self, part: Keys, request: GenerationRequest, entry_id: str) -> Checkpoint | None:
        """The checkpoint of this entry, with the parts saved after its last consolidation
        (:func:`~redroll.shared.checkpoint_reads.load_checkpoint`); None: start over."""
        return await load_checkpoint(self.ctx.redis, part, request.request_id, entry_id)

    async def discard(self, part: Keys, fields: dict, entry_id: str) -> None:
        """Delete the checkpoint of the entry in ``fields`` if it names this entry (a hand-back to
        a newer worker: a checkpoint written by an older schema's worker is not resumed)."""
        rid = fields.get(b"rid") or fields.get("rid")
        if rid is None:
            return
        key = part.partial(rid.decode() if isinstance(rid, bytes) else str(rid))
        try:
            head = await self.ctx.redis.getrange(key, 0, 43)
            if head and head.decode("ascii", "replace").strip() == entry_id:
                await self.ctx.redis.delete(key)
        except redis.RedisError as exc:
            log.warning("checkpoint %s not deleted: %s", key, exc)

    def saver(self, flight: Any, request: GenerationRequest, base: Checkpoint | None,
              periodic: bool = True) -> "Saver":
        return Saver(self, flight, request, base, periodic)

    async def close(self) -> None:
        await self.writer.close()


class Saver:
    """Saves one flight's new tokens while the engine generates it: registered with the worker's
    writer (:meth:`start`, :meth:`stop`), which asks it every tick whether a save is :meth:`due`;
    :meth:`flush` for what a drain or a notice cut short. A streamed request's saves are its
    chunks (see :mod:`.settled_text` for where one may end)."""

    def __init__(self, checkpoints: Checkpoints, flight: Any, request: GenerationRequest, base: Checkpoint | None,
                 periodic: bool = True):
        self.checkpoints = checkpoints
        self.periodic = periodic
        """Saved while it runs (else only by :meth:`flush`)."""
        self.ctx = checkpoints.ctx
        self.flight = flight
        self.request = request
        self.base = base.tokens if base else 0
        """Tokens in the checkpoint before this worker's generation began."""
        self.base_ids = list(base.token_ids) if base else []
        self.sent_text = base.text if base else ""
        """A streamed request's text so far (what its chunks carried, or would carry: see :mod:`.settled_text`)."""
        self.settles = request.stream or bool(request.sampling_params.stop)
        """Saves end where the text is settled (:mod:`.settled_text`): a streamed request's, and one
        with stop strings (a continuation sees every stop string whole in its own output)."""
        self.tokenizer = self.ctx.tokenizer if self.settles else None
        self.done = 0
        """Tokens of this worker's generation saved so far."""
        self.saves = 0
        """The saves of this delivery so far (its checkpoint event counts them)."""
        self.broken = False
        """A write was fenced or refused: this worker writes no more of it."""
        self.writing: asyncio.Future | None = None
        """The write of its last save, while it is under way."""
        self.length = base.size if base else HEADER_BYTES
        """The checkpoint key's bytes: as loaded (a new one's header) until this saver's first
        consolidation, then after its last one, which its next append is checked against (see
        checkpoint_many.lua)."""
        self.kept = base.kept if base else 0
        """Tokens the checkpoint key holds (the rest of what was saved is in parts: :attr:`later`)."""
        self.later: list[bytes] = list(base.later) if base else []
        """The parts saved since the key's last consolidation (read back with the base, then this
        saver's own), which its next consolidating save appends to the key before its own part."""
        self.consolidated_at = -float("inf")
        """When this saver last consolidated (its first save always does)."""
        settings = self.ctx.settings
        if request.stream:  # every K tokens or T ms, whichever comes first
            self.every_tokens, self.every_s, self.first = settings.stream_chunk_tokens, settings.stream_chunk_ms / 1000, True
        else:  # every N tokens or S seconds, whichever comes later
            self.every_tokens, self.every_s, self.first = settings.checkpoint_tokens, settings.checkpoint_interval_s, False
        self.last_save = time.monotonic()
        self.ttl_set_at = -float("inf")
        """When a save of this worker last set the chunk stream's TTL (a streamed request)."""
        self.next_look = 0.0
        """When :meth:`due` looks at the engine's partial output next."""

    def start(self) -> None:
        """Save while the generation runs (an engine without partial output saves only at a flush)."""
        if self.periodic and self.ctx.capabilities.partial_output:
            self.checkpoints.writer.add(self)

    async def stop(self) -> None:
        """No more saves while it runs; returns once a write under way settled (the finish that
        follows then never races it)."""
        self.checkpoints.writer.remove(self)
        if self.writing is not None:
            await asyncio.shield(self.writing)

    def due(self, now: float, beat: bool = False, checkpoint_beat: bool = True) -> Prepared | None:
        """The save to make now, if one is due (a write of this saver's still under way: none).
        ``beat``: the streams' shared timer beats now (a streamed request sends what it has);
        ``checkpoint_beat``: the checkpoints' beat (:data:`~.checkpoint_writes.CHECKPOINT_BEAT_S`),
        which a checkpoint saved less often than :data:`~.checkpoint_writes.SLOW_SAVE_S` waits for,
        so that the saves of many such requests share a call.
        Parts older than :data:`~.checkpoint_writes.CONSOLIDATE_S` are consolidated even when no
        new token came (a generation the engine holds back keeps no part only in the parts stream,
        which drops parts by age)."""
        if self.broken or self.writing is not None:
            return None
        overdue = bool(self.later) and now - self.consolidated_at >= CONSOLIDATE_S
        prepared = None if now < self.next_look else self._due(now, beat, checkpoint_beat)
        if prepared is None and overdue:
            prepared = self._consolidation()
        return prepared

    def _due(self, now: float, beat: bool, checkpoint_beat: bool) -> Prepared | None:
        if not self.first:
            # (a checkpoint is due only once its interval passed; then the engine's partial output,
            # which may copy it, is looked at a few times a second, not every tick)
            if now - self.last_save < self.every_s:
                self.next_look = self.last_save + self.every_s
                return None
            if not checkpoint_beat and now - self.last_save >= SLOW_SAVE_S:
                return None
            self.next_look = now + min(0.25, max(self.every_s / 4, 0.0))
        snap = self.ctx.engine.partial(self.flight.handle)
        new = 0 if snap is None else len(snap.token_ids) - self.done
        if new <= 0:
            return None
        enough = new >= self.every_tokens
        if not ((enough or beat) if self.first else (enough and now - self.last_save >= self.every_s)):
            return None
        return self.prepare(snap)

    async def flush(self, sample: SampleOutput) -> bool:
        """Save the rest of ``sample`` (the output a drain or a notice cut short) before the entry
        goes back; True when nothing of it is left unsaved."""
        if self.writing is not None:
            await asyncio.shield(self.writing)
        if self.broken:
            return False
        # (consolidated: the next worker reads the key alone)
        prepared = self.prepare(sample, consolidate=True)
        if prepared is None and self.later:  # (nothing new: the parts go into the key)
            prepared = self._consolidation()
        if prepared is not None:
            await self.checkpoints.writer.write([prepared])
        return not self.broken and self.done >= len(sample.token_ids)

    def prepare(self, sample: SampleOutput, consolidate: bool = False) -> Prepared | None:
        """What ``sample`` has past what was saved (a streamed request's: as far as it is settled),
        ready to write; None when there is nothing. A consolidating save (this saver's first, one
        every :data:`~.checkpoint_writes.CONSOLIDATE_S`, ``consolidate``: a flush) also appends the
        parts saved since the last one to the checkpoint key; any other is a part only."""
        start, end = self.done, len(sample.token_ids)
        text: str | None = None
        cut_text: str | None = None
        if self.settles:
            cut = settled(self.tokenizer, self.request, self.base_ids + list(sample.token_ids), self.base + start,
                          self.sent_text)
            end, cut_text = cut.tokens - self.base, cut.text
            if cut.text is not None and self.request.wants_text and self.request.stream:
                text = cut.text[len(self.sent_text):]
        ids = list(sample.token_ids[start:end])
        if not ids:
            return None
        version = str(self.ctx.engine.info.weight_version)
        versions = list(sample.weight_versions[start:end]) if sample.weight_versions else [version] * len(ids)
        mixed = len(set(versions)) > 1
        whole = end == len(sample.token_ids)
        piece = encode_part(Part(
            token_ids=ids, logprobs=list(sample.logprobs[start:end]) if sample.logprobs is not None else None,
            weight_version=None if mixed else versions[0], weight_versions=versions if mixed else None,
            worker=self.ctx.name, text=text,
            top_logprobs=[list(t) for t in sample.top_logprobs[start:end]]
            if self.request.top_logprobs_num and sample.top_logprobs is not None
            and len(sample.top_logprobs) >= end else None,
            finish_reason=sample.finish_reason if whole and sample.finish_reason in ("stop", "length") else None))
        request, flight = self.request, self.flight
        chunks = chunks_key_for(request.reply_to) if request.stream and request.reply_to else None
        now = time.monotonic()
        # (the chunk stream's TTL, set again every tenth of it: see checkpoint_many.lua)
        refresh_ttl = now - self.ttl_set_at >= self.ctx.settings.stream_chunk_ttl_s / 10
        consolidate = consolidate or not self.saves or now - self.consolidated_at >= CONSOLIDATE_S
        part = PartSave(requests_key=flight.stream, entry_id=flight.entry_id, request_id=request.request_id,
                        before=self.base + start, adding=len(ids), part=piece,
                        # (a consolidating save's chunk goes with its append to the key)
                        chunks_key=None if consolidate else chunks, refresh_ttl=refresh_ttl)
        save = None
        if consolidate:
            save = self._consolidating(len(ids), piece, chunks_key=chunks, refresh_ttl=refresh_ttl,
                                       owner_key=owner_key_for(request.reply_to) if chunks else None,
                                       check_owner=not self.saves)  # (its first save: see checkpoint_many.lua)
        return self._prepared(save, part, end, cut_text)

    def _consolidation(self) -> Prepared:
        """A consolidating save of the parts alone (no new token to save)."""
        return self._prepared(self._consolidating(0, b""), None, self.done, None)

    def _consolidating(self, adding: int, part: bytes, **chunk: Any) -> CheckpointSave:
        """The append to the checkpoint key of the parts it lacks and ``part`` (``adding`` tokens);
        ``chunk``: a streamed part's chunk fields."""
        return CheckpointSave(requests_key=self.flight.stream, partial_key=self._partial_key(),
                              entry_id=self.flight.entry_id, saved=self.kept, adding=adding, part=part,
                              length=self.length if self.saves else None,  # (its first save reads the header)
                              logged=self._logged(), number=self.saves + 1, prior=b"".join(self.later),
                              prior_tokens=self.later_tokens, **chunk)

    @property
    def later_tokens(self) -> int:
        """Tokens in :attr:`later`: what was saved (loaded and this saver's) less what the key holds."""
        return self.base + self.done - self.kept

    def _prepared(self, save: CheckpointSave | None, part: PartSave | None, end: int, text: str | None) -> Prepared:
        self.writing = asyncio.get_running_loop().create_future()
        return Prepared(self, save, part, end, text)

    def _partial_key(self) -> str:
        return self.ctx.part_of[self.flight.stream].partial(self.request.request_id)

    def _logged(self) -> bool:
        """Whether a consolidating save goes into the request's event log: with ``event_log=all``
        always; with ``incidents`` a checkpoint of a request that is not streamed once its delivery
        is an incident (taken back after a death, a hand-back or an error) or is handed back now.
        Saving is the normal course of a request that continues (the default), as chunks are of a
        streamed one: a first delivery's checkpoints begin no log."""
        if self.ctx.settings.event_log == "all":
            return True
        return not self.request.stream and (self.flight.taken_back or self.flight.handed_back)

    def settle(self, prepared: Prepared, outcome: tuple[int, int | str] | None) -> bool:
        """Take the write's ``outcome`` (None: not known, the connection failed: tried again at the
        next save, except a streamed request's part, which its readers may have: it saves no more);
        True when it was saved."""
        writing, self.writing = self.writing, None
        if writing is not None and not writing.done():
            writing.set_result(None)
        if outcome is None:
            if prepared.save is None and prepared.part is not None and prepared.part.chunks_key:
                self.broken = True
            return False
        code, detail = outcome
        if code != 1:
            log.warning("checkpoint of %s not saved: %s", self.request.request_id, detail)
            self.broken = True
            return False
        self.done = prepared.end
        self.saves += 1
        self.last_save = time.monotonic()
        save, part = prepared.save, prepared.part
        if save is not None:
            self.kept = save.count
            self.length += len(save.prior) + len(save.part)
            self.later = []
            self.consolidated_at = self.last_save
        elif part is not None:
            self.later.append(part.part)
        if any(w is not None and w.chunks_key and w.refresh_ttl for w in (save, part)):  # (the write with the chunk)
            self.ttl_set_at = self.last_save
        if self.settles and prepared.text is not None:
            self.sent_text = prepared.text
        self.ctx.stats.checkpoints += 1
        self.flight.checkpointed = True
        return True
