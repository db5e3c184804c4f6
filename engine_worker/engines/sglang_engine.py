"""The SGLang adapter: the Engine protocol on an in-process ``sglang.Engine``, for sglang 0.5.23.

The adapter is this module (lifecycle, validation, generate and abort) and three mixins by
concern: :mod:`.sglang_output` (SGLang's output as an EngineOutput), :mod:`.sglang_weights`
(weights and memory) and :mod:`.sglang_process` (stopping SGLang's processes).

sglang is imported lazily inside :meth:`SGLangEngine.start` (and the io_struct classes inside the
weight/memory calls), so importing this module needs neither sglang nor torch. Every name used
here is listed in :mod:`.sglang_contract` and checked against the pinned wheel by the contract
tests. References are to files under ``sglang/srt/`` of sglang 0.5.23, with their line numbers:

* ``Engine.__init__`` blocks its thread until the model is loaded (entrypoints/engine.py:278-396,
  ``wait_for_ready`` :1350): it runs off the event loop. The tokenizer manager binds to the loop of
  its first call (tokenizer_manager.py:2440-2463): :meth:`start` makes that call on the worker's
  loop. That call also installs SGLang's SIGTERM/SIGQUIT handlers on the loop (:2453-2459); its
  SIGTERM handler waits for idle, SIGKILLs every child and exits (:3508-3571), so whoever runs the
  worker installs its own handlers after :meth:`start` (``redroll worker`` does).
* Each sample is its own ``async_generate(..., rid=...)`` call (engine.py:545-601, ``rid`` :595):
  with ``n > 1`` SGLang gives samples fresh uuid rids (tokenizer_manager.py:2144, :2174) that
  could not be aborted. The scheduler aborts by rid *prefix* (scheduler.py:5688, :5800), so
  rids are fixed-width and prefix-free: ``rr-<8 hex>-<12-digit counter>-<sample index>``.
* Abort: ``abort_request`` sends one AbortReq per rid and drops every later call for it
  (``state.abort_sent``, tokenizer_manager.py:2241-2265). An abort that reached the scheduler
  before the request (still tokenizing, paused, waiting for a LoRA adapter: :926-950) would be
  lost. So a sample not yet dispatched (``ReqState.dispatched``, :281, set at :1810 right after
  the send) is aborted by cancelling its call: SGLang then drops the undelivered state and sends
  nothing (:3850-3874). A dispatched one is aborted once; the AbortReq follows the request on the
  same channel.
* Errors: a scheduler abort with status 400 raises ``ValueError``, 401-599 ``fastapi.HTTPException``
  (``_handle_abort_finish_reason``, :1891-1922), validation ``ValueError`` before dispatch
  (:1307-1435, :3736, :3835-3836). All become :class:`EngineRequestError`, unless the abort was ours.
* Limits: SGLang refuses ``input + reserved >= context`` and ``input + reserved + max_new >
  context`` (:1333-1378), and the scheduler ``input >= max_req_input_len`` (managers/utils.py:
  259-289). It then lowers ``max_new_tokens`` silently to ``max_req_len - input - 1`` (scheduler.py
  :2693-2740; ``max_req_len = max_req_input_len + 5``, tp_worker.py:568-572): the record says so
  in ``meta_info.max_new_tokens_effective``.
* A resumable request streams (``async_generate(stream=True)``, engine.py:645-646) with the
  per-request ``sampling_params.stream_interval`` (sampling_params.py:177), so :meth:`partial`
  can show the worker what has been made for its checkpoints; chunk lists are copied (SGLang
  hands out its live lists, tokenizer_manager.py:2651-2662) and the stream is always closed.
* ``sampling_seed`` is honoured only with ``--enable-deterministic-inference``, and then every
  unseeded request gets 42 (sampling/sampling_batch_info.py:157-172): each sample gets its own seed.
* Weights and memory are awaited on the tokenizer manager with io_struct inputs: the Engine's
  sync wrappers use ``loop.run_until_complete`` (engine.py:1702-1720, :1831-1841) and fail inside
  the worker's running loop.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import itertools
import logging
import secrets
from typing import Any, Callable

from redroll.engine_worker.engines.base import (
    EngineCapabilities,
    EngineCommandRefused,
    EngineInfo,
    EngineOutput,
    EngineRequestError,
    SampleOutput,
    WeightUpdateError,
)
from redroll.engine_worker.engines.sglang_checks import ENGINE_NAME, SGLangChecks
from redroll.engine_worker.engines.sglang_contract import SGLANG_VERSION
from redroll.engine_worker.engines.sglang_output import SGLangOutput, _Job, _request_error, _Sample
from redroll.engine_worker.engines.sglang_process import SGLangProcess
from redroll.engine_worker.engines.sglang_weights import SGLangWeights
from redroll.engine_worker.engines.text import add_text
from redroll.shared.types import GenerationRequest

log = logging.getLogger(__name__)


_ABORTED_MEMORY = 8192
"""How many aborted-but-not-yet-started handles are remembered (handles are unique per attempt)."""


class SGLangEngine(SGLangChecks, SGLangOutput, SGLangWeights, SGLangProcess):
    """Engine protocol on ``sglang.Engine`` (0.5.23), in this process and event loop."""

    capabilities = EngineCapabilities(weights_from_disk=True, weights_in_place=True, weights_from_push=True,
                                      weights_from_tensor=True, memory_release=True, partial_output=True,
                                      tokenizer=True)
    """What the adapter can do. Some of it needs SGLang started for it: a memory release without the
    memory saver, a push or a tensor update with dp_size > 1 are refused by the method, saying what
    to change (:class:`EngineCommandRefused`); :meth:`partial` shows only resumable requests (they
    stream); ``tokenizer`` is None with skip_tokenizer_init."""

    def __init__(
        self,
        model_path: str,
        *,
        tp_size: int = 1,
        dp_size: int = 1,
        mem_fraction_static: float | None = None,
        max_running_requests: int | None = None,
        context_length: int | None = None,
        dtype: str = "auto",
        random_seed: int | None = None,
        enable_memory_saver: bool = False,
        skip_tokenizer_init: bool = False,
        weight_version: str | None = None,
        extra_args: dict | None = None,
        engine_factory: Callable[..., Any] | None = None,
        shutdown_timeout_s: float = 30.0,
        pause_mode: str = "in_place",
        max_routed_experts_bytes: int = 2 * 1024 * 1024,
        checkpoint_stream_interval: int = 256,
    ) -> None:
        self.stream_interval = checkpoint_stream_interval
        """Resumable requests stream their output every this many tokens (the per-request
        ``sampling_params.stream_interval``, sampling_params.py:177), so the worker can checkpoint it."""
        self.max_routed_experts_bytes = max_routed_experts_bytes
        """The most routed-experts data one record may carry (see :meth:`_check_routed_experts`)."""
        if pause_mode not in ("in_place", "retract"):
            raise ValueError(f"pause_mode {pause_mode!r} is not in_place or retract")
        self.pause_mode = pause_mode
        """How an in-place weight update pauses SGLang (see :meth:`_paused_swap`)."""
        self.model_path = model_path
        self.loaded_model_path = model_path
        """The weights last loaded (``update_weights_from_disk`` changes it; ``info.model`` stays)."""
        self.skip_tokenizer_init = skip_tokenizer_init
        self._weight_version = weight_version
        self._engine_factory = engine_factory
        self.shutdown_timeout_s = shutdown_timeout_s
        named: dict[str, Any] = {
            "tp_size": tp_size,
            "dp_size": dp_size,
            "mem_fraction_static": mem_fraction_static,
            "max_running_requests": max_running_requests,
            "context_length": context_length,
            "dtype": dtype,
            "random_seed": random_seed,
            "enable_memory_saver": enable_memory_saver,
            "skip_tokenizer_init": skip_tokenizer_init,
            "weight_version": weight_version,
        }
        extra = dict(extra_args or {})
        clash = sorted(k for k in extra if k == "model_path" or (k in named and named[k] is not None))
        if clash:
            raise ValueError(f"extra_args repeats engine argument(s) {', '.join(clash)}; set them once")
        # Only what is set, so ServerArgs' own defaults apply to the rest (engine.py:297: ServerArgs(**kwargs)).
        self._engine_kwargs: dict[str, Any] = {"model_path": model_path}
        self._engine_kwargs.update({k: v for k, v in named.items() if v is not None})
        self._engine_kwargs.update(extra)
        self.memory_saver = bool(self._engine_kwargs.get("enable_memory_saver"))
        self.deterministic = bool(self._engine_kwargs.get("enable_deterministic_inference"))

        self.info = EngineInfo(name=ENGINE_NAME, model=model_path, weight_version=weight_version or "0",
                               max_context=context_length)
        self.engine: Any = None
        self.tokenizer: Any = None
        self.server_args: Any = None
        self._max_req_input_len: int | None = None
        self._reserved_tokens = 0
        self._lora_enabled = False
        self._released_tags: set[str] = set()
        """Memory tags released and not resumed yet (SGLang crashes on resuming any other)."""
        self._jobs: dict[str, _Job] = {}
        self._aborted: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._rid_prefix = f"rr-{secrets.token_hex(4)}-"
        self._seq = itertools.count(1)
        self.info.weight_ranks = int(tp_size or 1)
        self._routed_shape: tuple[int, int] | None = None
        """(layers, top-k) of an MoE model started with enable_return_routed_experts."""
        self._dp_size = int(dp_size or 1)
        self._group_name: str | None = None
        self._live_changed = False
        """A push reached the live weights (SGLang loads what it received at once)."""
        self._dispatch_open = asyncio.Event()
        self._dispatch_open.set()
        """Closed from an in-place swap until the prefix cache is flushed (see :meth:`_flush_after_swap`)."""
        self._flush_task: asyncio.Task | None = None
        self.cache_flushes = 0

    # ------------------------------------------------------------------ lifecycle

    @property
    def capacity(self) -> int | None:
        """Requests SGLang runs at once: ``max_running_requests`` as SGLang resolved it once started
        (its ServerArgs), else as given; None when neither says (SGLang sizes it from memory)."""
        for value in (getattr(self.server_args, "max_running_requests", None),
                      self._engine_kwargs.get("max_running_requests")):
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return None

    def engine_kwargs(self) -> dict[str, Any]:
        """The keyword arguments ``start()`` passes to ``sglang.Engine`` (ServerArgs names)."""
        return dict(self._engine_kwargs)

    async def start(self) -> None:
        """Build the engine (off the loop: it blocks until the model is loaded) and bind its
        tokenizer manager to this event loop."""
        if self.engine is not None:
            return
        factory = self._engine_factory
        if factory is None:
            import sglang  # lazy: the queue core must import without it

            _check_version(getattr(sglang, "__version__", None))
            factory = sglang.Engine
        engine = await asyncio.to_thread(lambda: factory(**self.engine_kwargs()))
        try:
            _require_rid_parameter(engine)
        except RuntimeError:
            await self._shutdown(engine)
            raise
        self.engine = engine
        engine.tokenizer_manager.auto_create_handle_loop()  # see the module docstring (signals)
        self._fill_info()

    def _fill_info(self) -> None:
        engine = self.engine
        tm = engine.tokenizer_manager
        model_config = getattr(tm, "model_config", None)
        self.server_args = getattr(tm, "server_args", None) or getattr(engine, "server_args", None)
        self.tokenizer = getattr(tm, "tokenizer", None)
        vocab = getattr(model_config, "vocab_size", None)
        context = getattr(tm, "context_len", None) or getattr(model_config, "context_len", None)
        self.info.vocab_size = int(vocab) if vocab else None
        self.info.max_context = int(context) if context else self.info.max_context
        max_input = getattr(tm, "max_req_input_len", None)  # set by engine.py:1355-1357 from the scheduler
        self._max_req_input_len = int(max_input) if isinstance(max_input, int) else None
        self._reserved_tokens = int(getattr(tm, "num_reserved_tokens", 0) or 0)  # :605 (EAGLE drafts)
        # The resolved value (tokenizer_manager.py:544): with only lora_paths given, the raw
        # server_args.enable_lora stays None (arg_groups/lora_hook.py:38-41 declare, not assign).
        self._lora_enabled = bool(getattr(tm, "enable_lora", False))
        # MoE routing replay (tokenizer_manager.py:2602-2609): only with enable_return_routed_experts
        # (fields/...: a plain field); sized from the model's config.
        hf_config = getattr(model_config, "hf_config", None)
        layers = getattr(hf_config, "num_hidden_layers", None)
        top_k = getattr(hf_config, "num_experts_per_tok", None)
        if getattr(self.server_args, "enable_return_routed_experts", False) and layers and top_k:
            self._routed_shape = (int(layers), int(top_k))
        if self.server_args is not None:
            self.deterministic = bool(getattr(self.server_args, "enable_deterministic_inference", self.deterministic))
            self.memory_saver = bool(getattr(self.server_args, "enable_memory_saver", self.memory_saver))
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            hf_eos = getattr(model_config, "hf_eos_token_id", None)  # configs/model_config.py: a set or None
            if isinstance(hf_eos, int):
                eos = hf_eos
            elif hf_eos:
                eos = min(hf_eos)
        self.info.eos_token_id = eos
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.info.pad_token_id = pad if pad is not None else eos
        server_version = getattr(self.server_args, "weight_version", None)  # fields/serving.py:172-175: "default"
        self.info.weight_version = self._weight_version or server_version or "0"

    async def close(self, timeout_s: float = 5.0) -> None:
        """Abort what is in flight, give it ``timeout_s`` to return, and stop SGLang's processes."""
        for job in list(self._jobs.values()):
            self._abort_job(job)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._jobs and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        if self._flush_task is not None:
            self._flush_task.cancel()
        self._dispatch_open.set()
        engine, self.engine = self.engine, None
        if engine is not None:
            await self._shutdown(engine)

    def _require_engine(self) -> Any:
        if self.engine is None:
            raise RuntimeError("SGLangEngine.start() has not been called (or the engine was closed)")
        return self.engine

    # ------------------------------------------------------------------ generate / abort

    async def generate(self, request: GenerationRequest, handle: str) -> EngineOutput:
        """Run the ``n`` samples of ``request`` as ``n`` concurrent SGLang requests."""
        engine = self._require_engine()
        if handle in self._jobs:
            raise ValueError(f"handle {handle!r} is already generating")
        n = request.n
        base = f"{self._rid_prefix}{next(self._seq):012d}"
        width = max(3, len(str(max(n - 1, 0))))
        job = _Job(handle, [f"{base}-{i:0{width}d}" for i in range(n)], return_logprob=request.return_logprob)
        if handle in self._aborted:
            del self._aborted[handle]
            job.aborted = True  # aborted before it started: start nothing
        seeds = self._sample_seeds(request)
        job.prompt_ids = self._prompt_ids_to_send(request)  # (a chat rendered here, once for all samples)
        self._jobs[handle] = job
        tasks = [asyncio.ensure_future(self._run_sample(engine, job, request, i, seeds[i])) for i in range(n)]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in done if not t.cancelled() and t.exception() is not None]
            if failed:
                # One sample failed: stop its siblings, let them return, then report the failure.
                self._abort_job(job)
                await asyncio.gather(*pending, return_exceptions=True)
                raise failed[0].exception()
            samples: list[_Sample] = [t.result() for t in tasks]
        except asyncio.CancelledError:
            self._abort_job(job)  # never leave SGLang generating for nobody
            for t in tasks:
                t.cancel()
            raise
        finally:
            self._jobs.pop(handle, None)
        output = add_text(self._engine_output(request, samples, job.prompt_ids), request, self.tokenizer)
        if any(s is not None for s in seeds) and self.deterministic:
            output.extra["sampling_seeds"] = seeds
        prompt_len = output.prompt_tokens
        effective = self.effective_max_new_tokens(prompt_len, request.sampling_params.max_new_tokens)
        if effective < request.sampling_params.max_new_tokens:
            output.extra["max_new_tokens_effective"] = effective
        return output

    def _sample_seeds(self, request: GenerationRequest) -> list[int | None]:
        """One seed per sample: the request's seed + index (separate requests with one seed would
        sample identical sequences). Unseeded samples under deterministic inference get a random
        seed each, since SGLang would give them all 42 (sampling_batch_info.py:157-172)."""
        seed = request.sampling_params.sampling_seed
        if seed is not None:
            return [seed + i for i in range(request.n)]
        if self.deterministic:
            return [secrets.randbits(63) for _ in range(request.n)]
        return [None] * request.n

    def abort(self, handle: str) -> None:
        """Abort every live sample of ``handle``; samples not yet started will not start."""
        job = self._jobs.get(handle)
        if job is None:
            self._aborted[handle] = None  # unique per attempt: an early abort for a later generate()
            while len(self._aborted) > _ABORTED_MEMORY:
                self._aborted.popitem(last=False)
            return
        self._abort_job(job)

    def _abort_job(self, job: _Job) -> None:
        job.aborted = True
        engine = self.engine
        if engine is None:
            return
        tm = engine.tokenizer_manager
        for rid, call in list(job.calls.items()):
            if call.done():
                continue
            state = tm.rid_to_state.get(rid)
            if rid not in job.started or (state is not None and not state.dispatched):
                # Not sent to the scheduler yet: cancel the call; SGLang drops the undelivered state and
                # sends nothing (tokenizer_manager.py:3850-3874). An abort sent now would reach the
                # scheduler before the request, and every later one would be dropped (:2249-2250).
                call.cancel()
            elif state is not None:
                try:
                    tm.abort_request(rid)  # dispatched: this one AbortReq follows the request (:2241-2265)
                except Exception:  # pragma: no cover - SGLang-side failure
                    log.exception("abort_request(%s) failed", rid)
            # (started and no state: it has finished; its output is on its way)

    async def _run_sample(self, engine: Any, job: _Job, request: GenerationRequest, index: int,
                          seed: int | None) -> _Sample:
        rid = job.rids[index]
        if job.aborted:
            return self._never_started(request)
        sampling = request.sampling_params.engine_kwargs()  # a fresh dict: SGLang may edit it in place
        if seed is not None:
            sampling["sampling_seed"] = seed
        kwargs: dict[str, Any] = {"sampling_params": sampling, "return_logprob": request.return_logprob, "rid": rid}
        if request.input_ids is not None or job.prompt_ids is not None:
            kwargs["input_ids"] = list(request.input_ids if request.input_ids is not None else job.prompt_ids)
        else:
            kwargs["prompt"] = request.prompt
        if request.lora_path is not None:
            kwargs["lora_path"] = request.lora_path
        if request.top_logprobs_num:
            kwargs["top_logprobs_num"] = request.top_logprobs_num
        if request.logprob_start_len is not None:
            kwargs["logprob_start_len"] = request.logprob_start_len
        if request.return_routed_experts:
            kwargs["return_routed_experts"] = True

        streaming = (request.resumable or request.stream) and request.n == 1

        async def call_sglang() -> Any:
            await self._dispatch_open.wait()  # (closed only while a flush after an in-place swap waits)
            job.started.add(rid)
            if streaming:
                return await self._streamed(engine, job, rid, kwargs, every_token=request.stream)
            return await engine.async_generate(**kwargs)

        call = asyncio.ensure_future(call_sglang())
        job.calls[rid] = call
        try:
            await asyncio.wait([call])  # (an abort may cancel the call; it never cancels this task)
        except asyncio.CancelledError:
            call.cancel()
            raise
        finally:
            job.calls.pop(rid, None)
        if call.cancelled():
            return self._never_started(request)  # our abort, before SGLang dispatched it
        exc = call.exception()
        if exc is not None:
            if job.aborted:
                log.debug("sample %s raised after our abort (%s); reporting it aborted", rid, exc)
                return self._never_started(request)
            raise _request_error(exc, rid) from exc
        return self._map_output(call.result(), job, request, rid)

    async def _streamed(self, engine: Any, job: _Job, rid: str, kwargs: dict[str, Any], *,
                        every_token: bool = False) -> dict[str, Any]:
        """One sample through ``async_generate(stream=True)`` (engine.py:645-646), its chunks kept
        in ``job.streamed`` as they come (for :meth:`partial`); returns what a non-streaming call
        would: the whole output_ids and output_token_logprobs with the last chunk's meta_info.

        Chunks are cumulative (the live lists, tokenizer_manager.py:2651-2662: copied here) unless
        the server runs with ``incremental_streaming_output`` (:2637-2648, deltas, coalesced by
        ``_wait_one_response`` :1983-1990). The generator is always closed: one left suspended keeps
        the tokenizer manager's reader lock and every weight update would wait on it (:941-957)."""
        # (a streamed request: every token, as SGLang's own server streams; the worker makes the chunks)
        kwargs["sampling_params"]["stream_interval"] = 1 if every_token else self.stream_interval
        incremental = bool(getattr(engine.tokenizer_manager, "incremental_streaming_output", False))  # :543
        ids: list[int] = []
        entries: list = []
        last: dict[str, Any] = {}
        stream = await engine.async_generate(**kwargs, stream=True)
        try:
            async for chunk in stream:
                meta = chunk.get("meta_info") or {}
                got_ids = list(chunk.get("output_ids") or [])
                got_entries = list(meta.get("output_token_logprobs") or [])
                if incremental:
                    ids, entries = ids + got_ids, entries + got_entries
                else:
                    ids, entries = got_ids, got_entries
                job.streamed[rid] = (ids, entries)
                last = chunk
        finally:
            await stream.aclose()
        meta = dict(last.get("meta_info") or {})
        if job.return_logprob:
            meta["output_token_logprobs"] = entries
        out = {**last, "output_ids": ids, "meta_info": meta}
        if incremental:
            out.pop("text", None)  # (the last delta's only: the whole text is decoded from the ids)
        return out

    def partial(self, handle: str) -> SampleOutput | None:
        """What the (single) streaming sample of ``handle`` has made so far; None when it does not
        stream (only resumable and streamed requests do) or nothing arrived yet."""
        job = self._jobs.get(handle)
        if job is None or not job.rids or job.rids[0] not in job.streamed:
            return None
        ids, entries = job.streamed[job.rids[0]]
        if not job.return_logprob:
            return SampleOutput(list(ids), None, None)
        if len(entries) != len(ids):
            return None  # (not lined up yet: saved at the next chunk rather than without logprobs)
        return SampleOutput(list(ids), [float(e[0]) for e in entries], None)


# ---------------------------------------------------------------------- helpers


def _check_version(version: str | None) -> None:
    if version != SGLANG_VERSION:
        log.warning("sglang %s is installed; redroll is tested with sglang %s (pip install 'redroll[sglang]')",
                    version, SGLANG_VERSION)


def _require_rid_parameter(engine: Any) -> None:
    """Per-sample rids need ``async_generate(rid=...)`` (entrypoints/engine.py:595)."""
    try:
        parameters = inspect.signature(engine.async_generate).parameters
    except (TypeError, ValueError, AttributeError):
        return
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    if "rid" not in parameters and not accepts_any:
        raise RuntimeError(f"this sglang's Engine.async_generate has no rid parameter; redroll needs sglang "
                           f"{SGLANG_VERSION}")


__all__ = ["ENGINE_NAME", "EngineCommandRefused", "EngineRequestError", "SGLANG_VERSION", "SGLangEngine",
           "WeightUpdateError"]
