"""The vLLM engine: redroll requests on vLLM's ``AsyncLLM`` (``vllm.v1``), in the worker's process.

What the adapter does, and why:

* **One vLLM request per sample.** A request with ``n`` samples becomes ``n`` vLLM requests
  (request ids ``rr-<random>-<seq>-<index>``), sample ``i`` seeded with ``sampling_seed + i``:
  the rule vLLM's own ``n`` follows and the transformers engine keeps, so the same seed gives the
  same tokens on every engine that shares it. Separate requests let one sample be aborted, report
  its partial output, or never start (``finish_reason`` None: ROLL's convention) on its own; the
  prompt's KV is still computed once, through the prefix cache (on by default).
* **Outputs.** A plain request asks vLLM for its final output only (``FINAL_ONLY``: one
  ``RequestOutput`` per sample, the cheapest). A resumable single-sample request streams deltas
  every ``checkpoint_stream_interval`` tokens (``DELTA`` with a per-request ``stream_interval``),
  kept here so that :meth:`partial` shows the worker what to checkpoint. An abort
  (``AsyncLLM.abort``) ends a sample with what it made so far (finish reason ``abort``).
* **Logprobs** are vLLM's ``processed_logprobs``: after penalties, temperature and top-k/top-p,
  i.e. the distribution the token was drawn from. The other engines report temperature-scaled
  logprobs before top-k/top-p; at temperature 1 without top-k/top-p the two agree.
  ``top_logprobs_num`` maps to vLLM's ``logprobs`` (the k most likely, by rank). Prompt logprobs
  (``logprob_start_len``) are computed by vLLM for the whole prompt and such a request skips the
  prefix cache for its prompt (its KV is computed in full); the adapter slices them from
  ``logprob_start_len``.
* **Text.** vLLM detokenizes a request that wants text (``output_text``) or has stop strings, and
  applies the stop strings itself: the text ends before the stop string (``no_stop_trim``: with
  it), the token ids run up to and including the token that completed it. Other requests are not
  detokenized (``detokenize=False``: RL's token-id requests spend nothing on text). A chat request
  is rendered here with the tokenizer's chat template and sent as token ids.
* **Tool calls and structured output** are vLLM's own (its parsers, its structured outputs with
  the xgrammar backend): see :mod:`.vllm_tools`, which also says what logprobs are under a grammar
  (the masked distribution) and why a continued structured request starts over.
* **Weight versions** are vLLM's own: the engine stamps every output with its current version
  (``update_weight_version``) and reports spans per sample, so an in-place update inside a
  generation shows in the record's per-token ``weight_versions``. Every request's prefix cache is
  salted with the weight version it starts under (``cache_salt``), so no request reuses KV
  computed by other weights.

The weight, memory and process parts live in :mod:`.vllm_weights` and :mod:`.vllm_process`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any, Sequence

from redroll.engine_worker.engines.base import (
    EngineCapabilities,
    EngineDeadError,
    EngineOutput,
    EngineRequestError,
    SampleOutput,
)
from redroll.engine_worker.engines.checks import check_token_ids, refuse_extras, refuse_text
from redroll.engine_worker.engines.text import prompt_token_ids
from redroll.engine_worker.engines.vllm_process import VLLMProcess
from redroll.engine_worker.engines.vllm_tools import VLLMTools
from redroll.engine_worker.engines.vllm_weights import VLLMWeights
from redroll.shared.codec import ValidationError
from redroll.shared.types import GenerationRequest

log = logging.getLogger(__name__)

ENGINE_NAME = "vllm"
LOGPROB_MODE = "processed: after penalties, temperature and top-k/top-p (the distribution sampled from)"

_ABORT_RETRY_S = 0.05
"""How often an abort is sent again while its sample has not ended: vLLM registers a request only
after tokenizing it (an abort sent before that is dropped), so the abort repeats until it lands."""

_REFUSED_SAMPLING_KEYS = {
    "structural_tag": "SGLang's structural tags", "stop_regex": "stop regexes", "custom_params": "custom logit processors",
}


@dataclass(eq=False)
class _Sample:
    """One vLLM request: what it made so far."""

    rid: str
    started: bool = False
    finished: bool = False
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int = 0
    prompt_logprobs: list[float | None] | None = None
    prompt_ids: list[int] | None = None
    weight_spans: Any = None


@dataclass(eq=False)
class _Job:
    """One ``generate`` call: ``n`` samples."""

    handle: str
    samples: list[_Sample]
    aborted: bool = False
    resender: asyncio.Task | None = None


class VLLMEngine(VLLMWeights):
    """Engine protocol on ``vllm.v1.engine.async_llm.AsyncLLM`` (0.32 to 0.34)."""

    capabilities = EngineCapabilities(weights_from_disk=True, weights_in_place=True, weights_from_push=True,
                                      memory_release=True,
                                      partial_output=True, progress_counters=True, prefill_counters=True,
                                      tokenizer=True)

    def __init__(self, model_path: str, *, checkpoint_stream_interval: int = 256, pause_mode: str = "in_place",
                 weight_version: str | None = None, tool_call_parser: str | None = None,
                 **engine_options: Any) -> None:
        if pause_mode not in ("in_place", "retract"):
            raise ValueError(f"pause_mode {pause_mode!r} is not in_place or retract")
        self.process = VLLMProcess(model_path, weight_version=weight_version, **engine_options)
        self.info = self.process.info
        self.info.name = ENGINE_NAME
        self.info.logprob_mode = LOGPROB_MODE
        self.pause_mode = pause_mode
        self.tools = VLLMTools(tool_call_parser)
        self.info.tool_call_parser = tool_call_parser
        if tool_call_parser is not None:
            self.info.tool_calls = self.tools.parse
        self.stream_interval = max(1, int(checkpoint_stream_interval))
        self.model_path = model_path
        self.loaded_model_path = model_path
        self._jobs: dict[str, _Job] = {}
        self._early_aborts: dict[str, None] = {}
        self._rid_prefix = f"rr-{secrets.token_hex(4)}-"
        self._seq = itertools.count(1)
        self.tokens_decoded = 0
        self.prefill_tokens_computed = 0
        self.prefill_tokens_cached = 0

    # ------------------------------------------------------------------ lifecycle

    @property
    def llm(self) -> Any:
        return self.process.llm

    @property
    def capacity(self) -> int | None:
        """Requests vLLM runs at once (``max_num_seqs``, as vLLM resolved it once started): a worker
        claims about this many (see :func:`redroll.engine_worker.claim.claim_limit`)."""
        llm = self.process.llm
        if llm is not None:
            return int(llm.vllm_config.scheduler_config.max_num_seqs)
        return self.process.engine_kwargs().get("max_num_seqs")

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (None before :meth:`start`, or when vLLM runs without one)."""
        return self.process.tokenizer

    def engine_kwargs(self) -> dict[str, Any]:
        """The ``AsyncEngineArgs`` keywords :meth:`start` uses."""
        return self.process.engine_kwargs()

    async def start(self) -> None:
        await self.process.start()
        try:
            self.tools.bind(self.process.tokenizer, self.info.eos_token_id)
        except BaseException:
            await self.process.close()
            raise

    async def close(self, timeout_s: float = 5.0) -> None:
        """Abort what is in flight, give it ``timeout_s`` to end, stop vLLM's processes."""
        for job in list(self._jobs.values()):
            self._abort_job(job)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._jobs and loop.time() < deadline:
            await asyncio.sleep(0.01)
        await self.process.close()

    # ------------------------------------------------------------------ validation

    def validate(self, request: GenerationRequest) -> None:
        """Refuse what vLLM would refuse (or what this adapter does not map), naming the field."""
        refuse_extras(request, ENGINE_NAME, top_logprobs=True, prompt_logprobs=True)
        check_token_ids(request, self.info.vocab_size, None)
        if request.lora_path is not None:
            raise ValidationError("lora_path", "the vllm engine serves no LoRA adapters")
        extra = request.sampling_params.extra
        for key, what in _REFUSED_SAMPLING_KEYS.items():
            if key in extra:
                raise ValidationError(f"sampling_params.{key}", f"the vllm engine does not take {what} ({key})")
        self.tools.check(request)
        if request.prompt is not None and request.input_ids is None and self.process.started \
                and self.process.tokenizer is None:
            raise ValidationError("prompt", "this vLLM engine runs without a tokenizer: send input_ids")
        if self.process.started:
            refuse_text(request, ENGINE_NAME, self.process.tokenizer)
        prompt_len = self._prompt_len(request)
        context = self.info.max_context
        if prompt_len is None or context is None:
            return
        field_name = "input_ids" if request.input_ids is not None else "prompt" if request.prompt else "messages"
        if prompt_len >= context:
            raise ValidationError(field_name, f"the prompt ({prompt_len} tokens) is not shorter than the model's "
                                              f"context length ({context} tokens)")
        if request.logprob_start_len is not None and request.logprob_start_len >= prompt_len:
            raise ValidationError("logprob_start_len", f"{request.logprob_start_len} is not inside the prompt "
                                                       f"({prompt_len} tokens)")
        max_new = request.sampling_params.max_new_tokens
        if prompt_len + max_new > context:
            raise ValidationError("sampling_params.max_new_tokens",
                                  f"prompt ({prompt_len}) + max_new_tokens ({max_new}) exceeds the model's "
                                  f"context length of {context} tokens")

    def _prompt_len(self, request: GenerationRequest) -> int | None:
        if request.input_ids is not None:
            return len(request.input_ids)
        tokenizer = self.process.tokenizer
        if (request.messages is not None or request.prefix_ids is not None) and tokenizer is not None:
            return len(prompt_token_ids(tokenizer, request, ENGINE_NAME) or ())  # (refuses a chat it cannot render)
        if request.prompt is None or tokenizer is None:
            return None
        try:
            return len(tokenizer.encode(request.prompt))
        except Exception:  # a tokenizer quirk must not become a dead letter here; vLLM decides
            return None

    # ------------------------------------------------------------------ generate / abort

    async def generate(self, request: GenerationRequest, handle: str) -> EngineOutput:
        """Run the ``n`` samples of ``request`` as ``n`` concurrent vLLM requests."""
        llm = self.process.require()
        if handle in self._jobs:
            raise ValueError(f"handle {handle!r} is already generating")
        n = request.n
        base = f"{self._rid_prefix}{next(self._seq):012d}"
        job = _Job(handle, [_Sample(f"{base}-{i:03d}") for i in range(n)])
        if handle in self._early_aborts:
            del self._early_aborts[handle]
            job.aborted = True  # aborted before it reached the engine: start nothing
        seed = request.sampling_params.sampling_seed
        prompt: dict[str, Any] = {"cache_salt": f"w{self.info.weight_version}"}
        if request.messages is not None or request.prefix_ids is not None:
            prompt["prompt_token_ids"] = prompt_token_ids(self.process.tokenizer, request, ENGINE_NAME)
        elif request.input_ids is not None:
            prompt["prompt_token_ids"] = list(request.input_ids)
        else:
            prompt["prompt"] = request.prompt
        structured = self.tools.structured_outputs(request)
        self._jobs[handle] = job
        tasks = [asyncio.ensure_future(self._run_sample(llm, job, request, s, None if seed is None else seed + i,
                                                        prompt, structured))
                 for i, s in enumerate(job.samples)]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in done if not t.cancelled() and t.exception() is not None]
            if failed:
                self._abort_job(job)  # one sample failed: stop its siblings, then report the failure
                await asyncio.gather(*pending, return_exceptions=True)
                raise failed[0].exception()  # type: ignore[misc]
        except asyncio.CancelledError:
            self._abort_job(job)  # never leave vLLM generating for nobody
            raise
        finally:
            self._jobs.pop(handle, None)
            if job.resender is not None:
                job.resender.cancel()
        return self._engine_output(request, job)

    async def _run_sample(self, llm: Any, job: _Job, request: GenerationRequest, sample: _Sample,
                          seed: int | None, prompt: dict[str, Any], structured: Any) -> None:
        if job.aborted:
            return
        streaming = (request.resumable or request.stream) and request.n == 1
        # (a streamed request: every token, as `vllm serve` streams; the worker makes the chunks)
        interval = 1 if request.stream else self.stream_interval
        params = self.process.sampling_params(request, seed, stream_interval=interval if streaming else None,
                                              structured_outputs=structured)
        sample.started = True
        try:
            async for out in llm.generate(dict(prompt), params, sample.rid):
                self._take(sample, out, request, delta=streaming)
        except Exception as exc:
            if job.aborted:
                log.debug("sample %s raised after our abort (%s): reported aborted", sample.rid, exc)
                sample.finish_reason = "abort" if sample.token_ids else None
                return
            if type(exc).__name__ == "EngineDeadError":  # (vLLM's EngineCore died: nothing runs here any more)
                raise EngineDeadError(f"vLLM's engine core died: {exc}") from exc
            raise _request_error(exc, sample.rid) from exc
        finally:
            sample.finished = True

    def _take(self, sample: _Sample, out: Any, request: GenerationRequest, *, delta: bool) -> None:
        """Fold one ``RequestOutput`` (a delta, or the final cumulative one) into ``sample``."""
        if sample.prompt_tokens is None and out.prompt_token_ids is not None:
            sample.prompt_tokens = len(out.prompt_token_ids)
            if request.return_prompt_token_ids:
                sample.prompt_ids = [int(t) for t in out.prompt_token_ids]
            sample.cached_tokens = int(out.num_cached_tokens or 0)
            self.prefill_tokens_computed += sample.prompt_tokens - sample.cached_tokens
            self.prefill_tokens_cached += sample.cached_tokens
        if out.prompt_logprobs is not None and sample.prompt_logprobs is None and request.logprob_start_len is not None:
            sample.prompt_logprobs = _prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs,
                                                      request.logprob_start_len)
        completion = out.outputs[0] if out.outputs else None
        if completion is None:
            return
        ids = [int(t) for t in completion.token_ids]
        logprobs, top = _token_logprobs(ids, completion.logprobs, request, sample.rid)
        text = completion.text or ""
        if delta:
            sample.token_ids.extend(ids)
            sample.logprobs.extend(logprobs)
            sample.top.extend(top)
            sample.text += text
        else:
            sample.token_ids, sample.logprobs, sample.top, sample.text = ids, logprobs, top, text
        if delta or out.finished:  # (a final-only output counts once, at the end)
            self.tokens_decoded += len(ids)
        if out.finished:
            sample.finish_reason = _finish_reason(completion.finish_reason, sample)
            sample.weight_spans = getattr(completion, "weight_versions", None)

    def abort(self, handle: str) -> None:
        """Abort every sample of ``handle``; samples not yet started will not start."""
        job = self._jobs.get(handle)
        if job is None:
            self._early_aborts[handle] = None  # (a handle is unique per attempt)
            while len(self._early_aborts) > 10_000:
                self._early_aborts.pop(next(iter(self._early_aborts)))
            return
        self._abort_job(job)

    def _abort_job(self, job: _Job) -> None:
        job.aborted = True
        if job.resender is None and self.process.llm is not None:
            job.resender = asyncio.ensure_future(self._send_aborts(job))

    async def _send_aborts(self, job: _Job) -> None:
        llm = self.process.llm
        while llm is not None:
            live = [s.rid for s in job.samples if s.started and not s.finished]
            if not live:
                return
            try:
                await llm.abort(live)
            except Exception:  # pragma: no cover - a dead engine: its generate() calls raise
                log.exception("vLLM abort(%s) failed", live)
                return
            await asyncio.sleep(_ABORT_RETRY_S)

    def partial(self, handle: str) -> SampleOutput | None:
        """What the streaming sample of ``handle`` (a resumable or streamed request) has made so far."""
        job = self._jobs.get(handle)
        if job is None or len(job.samples) != 1 or not job.samples[0].token_ids:
            return None
        s = job.samples[0]
        top = list(s.top) if len(s.top) == len(s.token_ids) else None
        return SampleOutput(list(s.token_ids), list(s.logprobs) if len(s.logprobs) == len(s.token_ids) else None, None,
                            top_logprobs=top)

    # ------------------------------------------------------------------ output

    def _engine_output(self, request: GenerationRequest, job: _Job) -> EngineOutput:
        samples = []
        for s in job.samples:
            if s.finish_reason is None and s.token_ids:
                s.finish_reason = "abort"  # (ended without a final output: our abort, or a closed engine)
            versions = _token_versions(s.weight_spans, len(s.token_ids), s.rid)
            samples.append(SampleOutput(
                token_ids=s.token_ids, logprobs=s.logprobs if request.return_logprob else None,
                finish_reason=s.finish_reason, weight_versions=versions,
                top_logprobs=s.top if request.return_logprob and request.top_logprobs_num else None,
                text=s.text if request.wants_text else None))
        prompt_tokens = max((s.prompt_tokens for s in job.samples if s.prompt_tokens is not None), default=None)
        if prompt_tokens is None:
            prompt_tokens = self._prompt_len(request) or 0
        spans = [s.weight_spans for s in job.samples if s.weight_spans]
        version = str(spans[-1][-1].version) if spans else self.info.weight_version
        if any(o.weight_versions for o in samples):
            for o, s in zip(samples, job.samples):  # one version per token for every sample once they differ
                if o.weight_versions is None and s.weight_spans:
                    o.weight_versions = [str(s.weight_spans[0].version)] * len(o.token_ids)
        input_logprobs = next((s.prompt_logprobs for s in job.samples if s.prompt_logprobs is not None), None)
        return EngineOutput(samples=samples, prompt_tokens=prompt_tokens,
                            cached_tokens=sum(s.cached_tokens for s in job.samples), weight_version=version,
                            input_logprobs=input_logprobs if request.return_logprob else None,
                            prompt_token_ids=next((s.prompt_ids for s in job.samples if s.prompt_ids is not None),
                                                  None))


# ---------------------------------------------------------------------- helpers


def _finish_reason(reason: Any, sample: _Sample) -> str | None:
    """vLLM's ``finish_reason`` string (``stop``, ``length``, ``abort``); an abort before the first
    token is a sample that never started (None)."""
    reason = None if reason is None else str(reason)
    if reason == "abort" and not sample.token_ids:
        return None
    if reason not in ("stop", "length", "abort"):
        raise EngineRequestError(f"vLLM returned an unknown finish reason {reason!r} for {sample.rid}", rid=sample.rid)
    return reason


def _token_logprobs(ids: Sequence[int], entries: Any, request: GenerationRequest,
                    rid: str) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """The sampled tokens' logprobs and, with ``top_logprobs_num``, the k most likely per position."""
    if not request.return_logprob:
        return [], []
    entries = list(entries or [])
    if len(entries) != len(ids):
        raise EngineRequestError(f"vLLM's logprobs ({len(entries)}) do not line up with its tokens ({len(ids)}) "
                                 f"for {rid}", rid=rid)
    k = request.top_logprobs_num
    logprobs, top = [], []
    for token, position in zip(ids, entries):
        logprobs.append(float(position[token].logprob))
        if k:
            ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in position.items() if lp.rank is not None
                            and lp.rank <= k)
            top.append([(int(tid), float(value)) for _, tid, value in ranked])
    return logprobs, top


def _prompt_logprobs(prompt_ids: Sequence[int], entries: Sequence[Any], start: int) -> list[float | None]:
    """The prompt tokens' logprobs from ``start`` on (vLLM computes them all; the first has none)."""
    out: list[float | None] = []
    for i in range(start, len(prompt_ids)):
        position = entries[i] if i < len(entries) else None
        out.append(None if position is None else float(position[prompt_ids[i]].logprob))
    return out


def _token_versions(spans: Any, num_tokens: int, rid: str) -> list[str] | None:
    """vLLM's per-sample ``weight_versions`` spans (``[start, end)`` over the output tokens) as one
    version per token; None when one version made them all."""
    if not spans or len(spans) < 2:
        return None
    versions: list[str] = []
    for span in spans:
        if span.start != len(versions) or span.end < span.start:
            raise EngineRequestError(f"vLLM's weight_versions spans {spans!r} are not contiguous for {rid}", rid=rid)
        versions.extend([str(span.version)] * (span.end - span.start))
    if len(versions) != num_tokens:
        raise EngineRequestError(f"vLLM's weight_versions cover {len(versions)} tokens, the output has "
                                 f"{num_tokens} for {rid}", rid=rid)
    return versions


def _request_error(exc: BaseException, rid: str) -> EngineRequestError:
    """vLLM's exception for one request as an :class:`EngineRequestError` (400 for its validation)."""
    if isinstance(exc, ValueError) or type(exc).__name__ in ("VLLMValidationError", "VLLMClientError"):
        return EngineRequestError(str(exc), status_code=400, rid=rid)
    return EngineRequestError(f"{type(exc).__name__}: {exc}", rid=rid)


__all__ = ["ENGINE_NAME", "LOGPROB_MODE", "VLLMEngine"]
