"""The SGLang adapter: the Engine protocol on an in-process ``sglang.Engine``, for sglang 0.5.23.

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
import atexit
import base64
import collections
import contextlib
import dataclasses
import importlib
import inspect
import itertools
import logging
import os
import secrets
import signal
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from redroll.shared.codec import ValidationError
from redroll.shared.types import GenerationRequest

from .base import EngineCapabilities, EngineInfo, EngineOutput, SampleOutput, check_token_ids
from .sglang_contract import MEMORY_TAGS, SGLANG_VERSION

log = logging.getLogger(__name__)

ENGINE_NAME = "sglang"

_ABORTED_MEMORY = 8192
"""How many aborted-but-not-yet-started handles are remembered (handles are unique per attempt)."""

_FINISH_TYPES = ("stop", "length", "abort")


class EngineRequestError(RuntimeError):
    """SGLang refused or failed one request for a reason other than an abort we asked for.

    ``status_code`` is the HTTP status SGLang attached (400 for bad input, 503 for a full queue,
    500 for internal errors), or None when the error carried none.
    """

    def __init__(self, message: str, *, status_code: int | None = None, rid: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.rid = rid


class WeightUpdateError(RuntimeError):
    """``update_weights_from_disk`` reported failure (SGLang keeps, or rolls back to, the old weights)."""


class EngineCommandRefused(RuntimeError):
    """A weight or memory command the adapter refuses because SGLang would crash on it, or it would
    do nothing (the message says which and what to do)."""


@dataclass(eq=False)
class _Job:
    """One ``generate`` call: n samples, each its own SGLang request."""

    handle: str
    rids: list[str]
    aborted: bool = False
    calls: dict[str, asyncio.Task] = field(default_factory=dict)
    """rid → the task running its ``async_generate`` call (while it runs)."""
    started: set[str] = field(default_factory=set)
    """rids whose call has begun (SGLang may hold state for them)."""
    streamed: dict[str, tuple[list[int], list]] = field(default_factory=dict)
    """rid → (output ids, output_token_logprobs entries) received so far, for streaming samples
    (copies: SGLang hands out its live lists, tokenizer_manager.py:2655-2662)."""
    return_logprob: bool = False


@dataclass
class _Sample:
    output: SampleOutput
    input_logprobs: list[float | None] | None = None
    prompt_tokens: int | None = None
    cached_tokens: int = 0
    weight_version: str | None = None
    e2e_latency: float | None = None


class SGLangEngine:
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

    async def _shutdown(self, engine: Any) -> None:
        """Stop SGLang without ``Engine.shutdown()``: that blocks the loop for up to 60 s, SIGKILLs
        every child of this process (not only SGLang's) and raises on timeout (entrypoints/engine.py
        :1450-1497, utils/common.py:2507-2564); it is also registered with atexit (:326). Here: stop
        its watchdog and tasks, and kill only the processes SGLang started (:398-400), reaped off
        the loop."""
        with contextlib.suppress(Exception):
            atexit.unregister(engine.shutdown)
        tm = getattr(engine, "tokenizer_manager", None)
        watchdog = getattr(tm, "_subprocess_watchdog", None)
        if watchdog is not None:
            with contextlib.suppress(Exception):
                watchdog.stop()
        for task in list(getattr(tm, "asyncio_tasks", ()) or ()):
            task.cancel()
        pids: list[int] = []
        with contextlib.suppress(Exception):
            pids = [int(p) for p in engine.get_all_child_pids()]
        for pid in pids:
            with contextlib.suppress(Exception):
                os.kill(pid, signal.SIGKILL)
        if pids:
            left = await asyncio.to_thread(_reap, pids, self.shutdown_timeout_s)
            if left:
                log.error("SGLang processes %s did not exit within %.0fs after SIGKILL", left, self.shutdown_timeout_s)

    def _require_engine(self) -> Any:
        if self.engine is None:
            raise RuntimeError("SGLangEngine.start() has not been called (or the engine was closed)")
        return self.engine

    # ------------------------------------------------------------------ validation

    def validate(self, request: GenerationRequest) -> None:
        """Refuse what SGLang would refuse, so it is dead-lettered at once instead of retried."""
        check_token_ids(request, self.info.vocab_size, None)
        if request.prompt is not None and request.input_ids is None and self._started_without_tokenizer():
            # tokenizer_manager.py _tokenize_one_request: "The engine initialized with
            # skip_tokenizer_init=True cannot accept text prompts."
            raise ValidationError("prompt", "this SGLang engine runs with skip_tokenizer_init: send input_ids")
        if request.lora_path is not None and self.engine is not None and not self._lora_enabled:
            # tokenizer_manager.py:3729-3736 (ValueError "LoRA is not enabled")
            raise ValidationError("lora_path", "LoRA is not enabled on this SGLang engine (start it with lora_paths)")
        prompt_len = self._prompt_len(request)
        if request.return_routed_experts:
            self._check_routed_experts(request, prompt_len)
        if prompt_len is None:
            return
        context = self.info.max_context
        max_new = request.sampling_params.max_new_tokens
        field_name = "input_ids" if request.input_ids is not None else "prompt"
        counted = prompt_len + self._reserved_tokens  # tokenizer_manager.py:1334-1335
        if context is not None and counted >= context:  # :1338
            raise ValidationError(field_name, f"the input ({counted} tokens) is longer than the model's "
                                              f"context length ({context} tokens)")
        if context is not None and counted + max_new > context:  # :1354-1358 (">": equal is accepted)
            raise ValidationError("sampling_params.max_new_tokens",
                                  f"prompt ({counted}) + max_new_tokens ({max_new}) exceeds the model's "
                                  f"context length of {context} tokens")
        # managers/utils.py:272 validate_input_length (scheduler): a 400 abort otherwise.
        if self._max_req_input_len is not None and prompt_len >= self._max_req_input_len:
            raise ValidationError(field_name, f"input length ({prompt_len} tokens) exceeds the engine's maximum "
                                              f"allowed length ({self._max_req_input_len} tokens)")

    def _check_routed_experts(self, request: GenerationRequest, prompt_len: int | None) -> None:
        """Routed experts travel in the record as raw int32 ``[tokens, layers, top_k]`` per sample,
        over prompt and output (``seqlen - 1`` tokens: layers/state_capturer/base.py:183-188), e.g.
        about 50 MB for 32k tokens x 48 layers x 8. A request whose worst case, ``(prompt +
        max_new_tokens - 1) x layers x top_k x 4 bytes x n``, exceeds ``max_routed_experts_bytes``
        is refused here, so no record outgrows what a stream entry should carry."""
        if self.engine is not None and self._routed_shape is None:
            raise ValidationError("return_routed_experts", "this SGLang engine does not return routed experts: start "
                                                           "it with --sglang-arg enable_return_routed_experts=true "
                                                           "on an MoE model")
        if self._routed_shape is None or prompt_len is None:
            return
        layers, top_k = self._routed_shape
        tokens = prompt_len + request.sampling_params.max_new_tokens - 1
        size = tokens * layers * top_k * 4 * request.n
        if size > self.max_routed_experts_bytes:
            raise ValidationError("return_routed_experts",
                                  f"the routed experts could take {size} bytes ({tokens} tokens x {layers} layers x "
                                  f"{top_k} experts x 4 bytes x n={request.n}), over this worker's "
                                  f"max_routed_experts_bytes of {self.max_routed_experts_bytes}; ask for fewer "
                                  "tokens or raise the limit (--max-routed-experts-bytes)")

    def effective_max_new_tokens(self, prompt_len: int, requested: int) -> int:
        """What SGLang's scheduler will really allow: ``min(requested, max_req_len - input - 1)``
        (scheduler.py:2710; ``max_req_len = max_req_input_len + 5``, tp_worker.py:568-572). Its KV
        memory cap (scheduler.py:2723, per batch) cannot be known here."""
        if self._max_req_input_len is None:
            return requested
        return max(0, min(requested, self._max_req_input_len + 5 - prompt_len - 1))

    def _started_without_tokenizer(self) -> bool:
        return self.skip_tokenizer_init or (self.engine is not None and self.tokenizer is None)

    def _prompt_len(self, request: GenerationRequest) -> int | None:
        if request.input_ids is not None:
            return len(request.input_ids)
        if request.prompt is not None and self.tokenizer is not None:
            try:
                return len(self.tokenizer.encode(request.prompt))
            except Exception:  # a tokenizer quirk must not turn into a dead letter
                return None
        return None

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
        output = self._engine_output(request, samples)
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
        if request.input_ids is not None:
            kwargs["input_ids"] = list(request.input_ids)
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

        streaming = request.resumable and request.n == 1

        async def call_sglang() -> Any:
            await self._dispatch_open.wait()  # (closed only while a flush after an in-place swap waits)
            job.started.add(rid)
            if streaming:
                return await self._streamed(engine, job, rid, kwargs)
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

    async def _streamed(self, engine: Any, job: _Job, rid: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """One sample through ``async_generate(stream=True)`` (engine.py:645-646), its chunks kept
        in ``job.streamed`` as they come (for :meth:`partial`); returns what a non-streaming call
        would: the whole output_ids and output_token_logprobs with the last chunk's meta_info.

        Chunks are cumulative (the live lists, tokenizer_manager.py:2651-2662: copied here) unless
        the server runs with ``incremental_streaming_output`` (:2637-2648, deltas, coalesced by
        ``_wait_one_response`` :1983-1990). The generator is always closed: one left suspended keeps
        the tokenizer manager's reader lock and every weight update would wait on it (:941-957)."""
        kwargs["sampling_params"]["stream_interval"] = self.stream_interval
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
        return {**last, "output_ids": ids, "meta_info": meta}

    def partial(self, handle: str) -> SampleOutput | None:
        """What the (single) streaming sample of ``handle`` has made so far; None when it does not
        stream (only resumable requests do) or nothing arrived yet."""
        job = self._jobs.get(handle)
        if job is None or not job.rids or job.rids[0] not in job.streamed:
            return None
        ids, entries = job.streamed[job.rids[0]]
        if not job.return_logprob:
            return SampleOutput(list(ids), None, None)
        if len(entries) != len(ids):
            return None  # (not lined up yet: saved at the next chunk rather than without logprobs)
        return SampleOutput(list(ids), [float(e[0]) for e in entries], None)

    # ------------------------------------------------------------------ output mapping

    def _map_output(self, out: Any, job: _Job, request: GenerationRequest, rid: str) -> _Sample:
        if not isinstance(out, dict):
            raise EngineRequestError(f"SGLang returned {type(out).__name__} for rid {rid}, expected one dict "
                                     "(was n passed to SGLang?)", rid=rid)
        meta = out.get("meta_info") or {}
        finish = meta.get("finish_reason")
        reason = _finish_type(finish)
        if reason == "abort" and not job.aborted:
            # Not our abort: an error abort SGLang returned instead of raising (no status code), or an
            # abort from elsewhere (abort_all by a pause or a weight update with abort_all_requests).
            # Nobody asked to abort this request: retry it.
            status = finish.get("status_code") if isinstance(finish, dict) else None
            message = finish.get("message") if isinstance(finish, dict) else None
            raise EngineRequestError(f"aborted inside SGLang, not by redroll: {message or 'Aborted'}",
                                     status_code=int(status) if status is not None else None, rid=rid)
        if reason is None or reason not in _FINISH_TYPES:
            if job.aborted:
                reason = "abort"
            else:
                raise EngineRequestError(f"SGLang returned an unfinished or unknown finish reason {finish!r} "
                                         f"for rid {rid}", rid=rid)
        token_ids = [int(t) for t in (out.get("output_ids") or [])]
        logprobs: list[float] | None = None
        if request.return_logprob:
            # (logprob, token_id, text|None) per output token (tokenizer_manager.py:3104-3116)
            entries = meta.get("output_token_logprobs") or []
            if len(entries) != len(token_ids) or any(
                    e[1] is not None and int(e[1]) != t for e, t in zip(entries, token_ids)):
                raise EngineRequestError(f"SGLang's output_token_logprobs ({len(entries)}) do not line up with "
                                         f"output_ids ({len(token_ids)}) for rid {rid}", rid=rid)
            logprobs = [float(e[0]) for e in entries]
        prompt_tokens = meta.get("prompt_tokens")  # absent for an abort in the waiting queue (:3603-3628)
        latency = meta.get("e2e_latency")
        top = None
        if request.return_logprob and request.top_logprobs_num:
            # per output position, (logprob, token_id, text|None) tuples or None (:3118-3136)
            positions = meta.get("output_top_logprobs") or []
            if len(positions) != len(token_ids):
                raise EngineRequestError(f"SGLang's output_top_logprobs ({len(positions)}) do not line up with "
                                         f"output_ids ({len(token_ids)}) for rid {rid}", rid=rid)
            top = [[(int(e[1]), float(e[0])) for e in (position or ())] for position in positions]
        input_logprobs = None
        if request.return_logprob and request.logprob_start_len is not None:
            # from logprob_start_len on; the first prompt token has no logprob (None)
            input_logprobs = [None if e[0] is None else float(e[0]) for e in meta.get("input_token_logprobs") or []]
        return _Sample(
            output=SampleOutput(token_ids=token_ids, logprobs=logprobs, finish_reason=reason,
                                weight_versions=_token_versions(meta.get("weight_versions"), len(token_ids), rid),
                                top_logprobs=top, routed_experts=self._routed_experts(meta, rid)),
            input_logprobs=input_logprobs,
            prompt_tokens=int(prompt_tokens) if prompt_tokens is not None else None,
            cached_tokens=int(meta.get("cached_tokens") or 0),
            weight_version=meta.get("weight_version"),
            e2e_latency=float(latency) if latency is not None else None,
        )

    def _routed_experts(self, meta: dict, rid: str) -> Any:
        """``meta_info["routed_experts"]``: base64 of raw int32 (detokenizer_manager.py:432-448), only
        on the finished output (tokenizer_manager.py:2602-2609)."""
        encoded = meta.get("routed_experts")
        if encoded is None or self._routed_shape is None:
            return None
        from redroll.shared.types import RoutedExperts

        data = base64.b64decode(encoded)
        layers, top_k = self._routed_shape
        if len(data) % (4 * layers * top_k):
            raise EngineRequestError(f"SGLang's routed_experts ({len(data)} bytes) do not divide into "
                                     f"{layers} layers x {top_k} experts for rid {rid}", rid=rid)
        return RoutedExperts(shape=(len(data) // (4 * layers * top_k), layers, top_k), data=data)

    @staticmethod
    def _never_started(request: GenerationRequest) -> _Sample:
        return _Sample(SampleOutput(token_ids=[], logprobs=[] if request.return_logprob else None,
                                    finish_reason="abort"))

    def _engine_output(self, request: GenerationRequest, samples: Sequence[_Sample]) -> EngineOutput:
        prompt_tokens = max((s.prompt_tokens for s in samples if s.prompt_tokens is not None), default=None)
        if prompt_tokens is None:  # e.g. every sample aborted in SGLang's waiting queue
            prompt_tokens = self._prompt_len(request) or 0
        versions = [s.weight_version for s in samples if s.weight_version is not None]
        latencies = [s.e2e_latency for s in samples if s.e2e_latency is not None]
        extra: dict[str, Any] = {}
        if latencies:
            extra["e2e_latency"] = max(latencies)
        version = str(versions[-1]) if versions else self.info.weight_version
        if any(s.output.weight_versions for s in samples) or any(str(v) != version for v in versions):
            for s in samples:  # one version per token for every sample once they differ
                if s.output.weight_versions is None and s.weight_version is not None:
                    s.output.weight_versions = [str(s.weight_version)] * len(s.output.token_ids)
        return EngineOutput(
            samples=[s.output for s in samples],
            prompt_tokens=prompt_tokens,
            cached_tokens=sum(s.cached_tokens for s in samples),
            weight_version=version,
            extra=extra,
            input_logprobs=next((s.input_logprobs for s in samples if s.input_logprobs is not None), None),
        )

    # ------------------------------------------------------------------ weights and memory

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                       load_format: str | None = None, *, in_place: bool = False) -> str:
        """Load new weights from ``model_path``; returns SGLang's message, raises :class:`WeightUpdateError`.

        Without ``in_place`` SGLang waits for the requests in flight (tokenizer_manager.py:2306-2309
        takes the writer lock; every generate_request holds the reader lock, :941-957). With it,
        generation is paused for the load and goes on afterwards (:meth:`_paused_swap`).
        """
        engine = self._require_engine()
        cls = self._io_class("UpdateWeightFromDiskReqInput")
        kwargs: dict[str, Any] = {"model_path": model_path, "load_format": load_format}
        if weight_version is not None:
            if dataclasses.is_dataclass(cls) and "weight_version" not in {f.name for f in dataclasses.fields(cls)}:
                raise WeightUpdateError("this SGLang's UpdateWeightFromDiskReqInput has no weight_version field")
            kwargs["weight_version"] = weight_version

        async def load(flush_cache: bool) -> tuple[bool, str]:
            # (success, message, num_paused_requests) (tokenizer_manager.py:2288-2322)
            result = await engine.tokenizer_manager.update_weights_from_disk(cls(**kwargs, flush_cache=flush_cache), None)
            return _update_result(result)

        success, message = await (self._paused_swap(load) if in_place else load(True))
        if not success:
            raise WeightUpdateError(f"update_weights_from_disk({model_path!r}) failed: {message}")
        self.loaded_model_path = model_path
        self.info.weight_version = weight_version or self.info.weight_version
        return message

    # ------------------------------------------------------------------ a trainer's push

    def _require_single_dp(self, what: str) -> None:
        """SGLang asserts ``dp_size == 1`` for every weight-sync call (tokenizer_control_mixin.py
        :451, :464, :509, :569); a failed assert would surface as an AssertionError mid-push."""
        if self._dp_size > 1:
            raise EngineCommandRefused(f"{what} needs an SGLang engine with dp_size 1 (SGLang refuses it for "
                                       f"data-parallel replicas); this worker runs dp_size {self._dp_size}: run one "
                                       "worker per GPU set instead (compose.yaml: one service per device set)")

    async def join_weight_group(self, *, address: str, port: int, rank_offset: int, world_size: int,
                                group_name: str, backend: str, timeout_s: float) -> None:
        """Have SGLang's scheduler join the trainer's group (tokenizer_control_mixin.py:445-456;
        it builds its side with ``init_custom_process_group``, utils/common.py:2859-2927, one rank
        per tensor-parallel GPU: rank_offset + tp_rank). SGLang's communicator waits without a
        timeout, so the wait here has one; the scheduler's own rendezvous gives up after c10d's
        default timeout (30 minutes, utils/common.py:2891-2892)."""
        self._require_single_dp("a weight push")
        tm = self._require_engine().tokenizer_manager
        await self.leave_weight_group()
        cls = self._io_class("InitWeightsUpdateGroupReqInput")
        obj = cls(master_address=address, master_port=port, rank_offset=rank_offset, world_size=world_size,
                  group_name=group_name, backend=backend)
        success, message = _update_result(await asyncio.wait_for(tm.init_weights_update_group(obj, None), timeout_s))
        if not success:
            raise WeightUpdateError(f"SGLang could not join weight-update group {group_name!r}: {message}")
        self._group_name = group_name
        self._live_changed = False

    async def receive_weights(self, specs: Sequence[Any], *, group_name: str, version: str,
                              in_place: bool = True) -> None:
        """Receive the broadcast into SGLang (one tensor per broadcast, in order: model_runner_components/
        weight_updater.py:260-298) inside the begin/end bracket SGLang requires since 0.5.21
        (scheduler_components/weight_updater.py:192-197). SGLang loads what it received at once,
        before the trainer commits: a receive that failed leaves the old weights (the load runs only
        after every tensor arrived, :199-218), a failed load may leave a mix."""
        if self._group_name != group_name:
            raise RuntimeError(f"not in weight-update group {group_name!r}")
        self._require_single_dp("a weight push")
        tm = self._require_engine().tokenizer_manager
        cls = self._io_class("UpdateWeightsFromDistributedReqInput")
        names = [spec.name for spec in specs]
        dtypes = [spec.dtype for spec in specs]
        shapes = [list(spec.shape) for spec in specs]

        async def receive(flush_cache: bool) -> tuple[bool, str]:
            obj = cls(names=names, dtypes=dtypes, shapes=shapes, group_name=group_name, flush_cache=flush_cache,
                      weight_version=version)
            return await self._in_session(tm, lambda: tm.update_weights_from_distributed(obj, None))

        success, message = await (self._paused_swap(receive) if in_place else receive(True))
        if not success:
            raise WeightUpdateError(f"SGLang did not take the pushed weights: {message}")
        self.info.weight_version = version

    async def commit_weights(self, version: str) -> None:
        """SGLang serves what it received since :meth:`receive_weights`; the commit only confirms it."""
        self.info.weight_version = version

    async def discard_weights(self) -> bool:
        """True when SGLang still serves the weights it had before the push."""
        return not self._live_changed

    async def leave_weight_group(self) -> None:
        name, self._group_name = self._group_name, None
        if name is None or self.engine is None:
            return
        cls = self._io_class("DestroyWeightsUpdateGroupReqInput")
        try:
            success, message = _update_result(await asyncio.wait_for(
                self.engine.tokenizer_manager.destroy_weights_update_group(cls(group_name=name), None), 30.0))
        except Exception as exc:  # (leaving must not fail a push that already ended)
            log.warning("SGLang could not leave weight-update group %s: %s: %s", name, type(exc).__name__, exc)
            return
        if not success:
            log.warning("SGLang could not leave weight-update group %s: %s", name, message)

    async def update_weights_from_tensor(self, named_tensors: Any, version: str, *, in_place: bool = True) -> str:
        """Tensors from this host (a colocated trainer): serialized once per tensor-parallel rank
        with SGLang's ``MultiprocessingSerializer`` (utils/common.py:3060-3082, as Engine's own wrapper
        does, entrypoints/engine.py:1743-1760: CUDA tensors travel as IPC handles) and loaded inside
        the begin/end bracket (scheduler_components/weight_updater.py:234-239)."""
        self._require_single_dp("update_weights_from_tensor")
        tm = self._require_engine().tokenizer_manager
        tensors = [(name, tensor.detach()) for name, tensor in named_tensors]
        serializer = self._sglang_name("utils", "MultiprocessingSerializer")
        payloads = [serializer.serialize(tensors) for _ in range(self.info.weight_ranks)]
        cls = self._io_class("UpdateWeightsFromTensorReqInput")

        async def load(flush_cache: bool) -> tuple[bool, str]:
            obj = cls(serialized_named_tensors=payloads, flush_cache=flush_cache, weight_version=version)
            return await self._in_session(tm, lambda: tm.update_weights_from_tensor(obj, None))

        success, message = await (self._paused_swap(load) if in_place else load(True))
        if not success:
            raise WeightUpdateError(f"update_weights_from_tensor failed: {message}")
        self.info.weight_version = version
        return message

    async def _in_session(self, tm: Any, update: Callable[[], Any]) -> tuple[bool, str]:
        """``begin_weight_update`` / the update / ``end_weight_update`` (tokenizer_control_mixin.py
        :485-501; the scheduler refuses tensor and distributed updates outside, weight_updater.py
        :192-197, :234-239)."""
        begin = self._io_class("BeginWeightUpdateReqInput")
        end = self._io_class("EndWeightUpdateReqInput")
        success, message = _update_result(await tm.begin_weight_update(begin(), None))
        if not success:
            return False, f"begin_weight_update: {message}"
        try:
            self._live_changed = True
            success, message = _update_result(await update())
            if not success and message.startswith("Failed to receive weights"):
                self._live_changed = False  # nothing was loaded (weight_updater.py:207-209)
        finally:
            end_ok, end_message = _update_result(await tm.end_weight_update(end(), None))
            if not end_ok:
                log.warning("end_weight_update: %s", end_message)
        return success, message

    async def _paused_swap(self, update: Callable[[bool], Any]) -> tuple[bool, str]:
        """Swap weights under the requests in flight, without aborting or waiting for them.

        SGLang has no ``Engine`` wrapper for this; its server awaits the tokenizer manager's
        coroutines (http_server.py:1831-1854, io_struct.py:1929). Paused, an update skips the writer
        lock that would wait for every request (tokenizer_control_mixin.py:471-483, :517-524).

        * ``pause_mode="in_place"`` (default): running requests keep their KV cache, computed with
          the old weights, and go on with the new ones. SGLang's flush after the update would fail
          while they run and fail the whole call (scheduler_components/weight_updater.py:120-133), so
          the update runs with ``flush_cache=False``, and the flush follows once no request spans
          the swap (:meth:`_flush_after_swap`): until then this engine dispatches no new request, so
          none reuses a prefix cached under the old weights.
        * ``pause_mode="retract"``: running requests go back to the waiting queue and are recomputed
          with the new weights (their KV cache freed), so the cache is flushed with the update.
        """
        tm = self._require_engine().tokenizer_manager
        pause = self._io_class("PauseGenerationReqInput")
        resume = self._io_class("ContinueGenerationReqInput")
        in_place = self.pause_mode == "in_place"
        await tm.pause_generation(pause(mode=self.pause_mode))
        try:
            result = await update(not in_place)
        finally:
            if in_place:
                self._dispatch_open.clear()
            await tm.continue_generation(resume())
        if in_place:
            if self._flush_task is not None and not self._flush_task.done():
                self._flush_task.cancel()
            self._flush_task = asyncio.ensure_future(self._flush_after_swap())
        return result

    async def _flush_after_swap(self, poll_s: float = 0.02, retries: int = 50) -> None:
        """Once SGLang holds no request (those that spanned the swap finished), flush the prefix
        cache (tokenizer_control_mixin.py:325-334; refused while any request runs, scheduler.py
        :5518-5547), then let new requests in. SGLang signals neither, so this polls."""
        tm = self._require_engine().tokenizer_manager
        try:
            for _ in range(retries):
                while tm.rid_to_state:
                    await asyncio.sleep(poll_s)
                result = await tm.flush_cache()
                if getattr(result, "success", False):
                    self.cache_flushes += 1
                    return
                await asyncio.sleep(poll_s)
            log.warning("SGLang refused to flush its cache after an in-place weight update %d times; new requests "
                        "may reuse a prefix cached under the old weights", retries)
        finally:
            self._dispatch_open.set()

    async def release_memory_occupation(self, tags: list[str] | None = None, *, idle_timeout_s: float = 30.0) -> None:
        """Free GPU memory (weights, KV cache, CUDA graphs) until :meth:`resume_memory_occupation`.

        Refused (:class:`EngineCommandRefused`) when it would free nothing (no memory saver:
        utils/torch_memory_saver_adapter.py:29-52, 156-160), for a tag already released, and when
        SGLang still holds requests: the release asserts an idle scheduler (weight_updater.py:339-341)
        and a failed assert kills the scheduler, which SIGQUITs this process (scheduler.py:6370-6373).
        """
        engine = self._require_engine()
        if not self.memory_saver:
            raise EngineCommandRefused("releasing memory frees nothing without the memory saver: start the "
                                       "worker with --enable-memory-saver")
        tags = list(tags) if tags else list(MEMORY_TAGS)
        unknown = sorted(set(tags) - set(MEMORY_TAGS))
        if unknown:
            raise EngineCommandRefused(f"unknown memory tag(s) {unknown}; SGLang has {list(MEMORY_TAGS)}")
        again = sorted(set(tags) & self._released_tags)
        if again:
            raise EngineCommandRefused(f"memory tag(s) {again} are released already; resume them first")
        tm = engine.tokenizer_manager
        deadline = asyncio.get_running_loop().time() + idle_timeout_s
        while tm.rid_to_state:
            if asyncio.get_running_loop().time() > deadline:
                raise EngineCommandRefused(f"SGLang still holds {len(tm.rid_to_state)} request(s) after "
                                           f"{idle_timeout_s:.0f}s; a release needs an idle scheduler")
            await asyncio.sleep(0.05)
        cls = self._io_class("ReleaseMemoryOccupationReqInput")
        await tm.release_memory_occupation(cls(tags=tags), None)
        self._released_tags |= set(tags)

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Take back what :meth:`release_memory_occupation` freed (by default all of it). Resuming
        a tag that was not released raises KeyError in the scheduler, which then SIGQUITs this process
        (weight_updater.py:390, scheduler.py:6370-6373): refused here instead."""
        engine = self._require_engine()
        tags = list(tags) if tags else sorted(self._released_tags)
        if not tags:
            raise EngineCommandRefused("no engine memory is released: nothing to resume")
        never = sorted(set(tags) - self._released_tags)
        if never:
            raise EngineCommandRefused(f"memory tag(s) {never} were not released; resume only {sorted(self._released_tags)}")
        cls = self._io_class("ResumeMemoryOccupationReqInput")
        await engine.tokenizer_manager.resume_memory_occupation(cls(tags=tags), None)
        self._released_tags -= set(tags)

    @property
    def released_tags(self) -> list[str]:
        return sorted(self._released_tags)

    def _io_class(self, name: str) -> type:
        """An io_struct class: from the engine factory (its ``io_struct`` attribute or its module, the
        seam for stand-ins), else from ``sglang.srt.managers.io_struct``."""
        return self._sglang_name("io_struct", name)

    def _sglang_name(self, module: str, name: str) -> Any:
        """``name`` from ``sglang.srt.managers.io_struct`` (module "io_struct") or
        ``sglang.srt.utils`` (module "utils"), or from the engine factory's attribute of that name."""
        factory = self._engine_factory
        if factory is not None:
            source = getattr(factory, module, None)
            if source is not None and hasattr(source, name):
                return getattr(source, name)
            if module != "io_struct":
                raise AttributeError(f"the engine factory has no {module}.{name}")
            module_name = getattr(factory, "__module__", None) or getattr(
                getattr(factory, "func", None), "__module__", None)
            module = sys.modules.get(module_name) if module_name else None
            if module is not None and hasattr(module, name):
                return getattr(module, name)
        path = {"io_struct": "sglang.srt.managers.io_struct", "utils": "sglang.srt.utils"}[module]
        return getattr(importlib.import_module(path), name)


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


def _reap(pids: list[int], timeout_s: float) -> list[int]:
    """Wait (in a thread) until ``pids`` are gone; returns those still there after ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    left = list(pids)
    while left and time.monotonic() < deadline:
        still = []
        for pid in left:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not our child (or reaped): is it still there?
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    continue
                still.append(pid)
                continue
            if done == 0:
                still.append(pid)
        left = still
        if left:
            time.sleep(0.05)
    return left


def _token_versions(spans: Any, num_tokens: int, rid: str) -> list[str] | None:
    """SGLang's ``meta_info["weight_versions"]`` (utils/weight_versions.py:90-107: contiguous
    half-open ``[start, end)`` spans over the output tokens, equal neighbours merged) as one version
    per token; None when one version made them all (``meta_info.weight_version`` says which)."""
    if not spans or len(spans) < 2:
        return None
    versions: list[str] = []
    for span in spans:
        start, end = int(span["start"]), int(span["end"])
        if start != len(versions) or end < start:
            raise EngineRequestError(f"SGLang's weight_versions spans {spans!r} are not contiguous for rid {rid}",
                                     rid=rid)
        versions.extend([str(span["version"])] * (end - start))
    if len(versions) != num_tokens:
        raise EngineRequestError(f"SGLang's weight_versions cover {len(versions)} tokens, the output has "
                                 f"{num_tokens} for rid {rid}", rid=rid)
    return versions


def _finish_type(finish: Any) -> str | None:
    if isinstance(finish, dict):
        value = finish.get("type")
        return str(value) if value is not None else None
    if isinstance(finish, str):
        return finish
    return None


def _request_error(exc: BaseException, rid: str) -> EngineRequestError:
    """SGLang's exceptions for one request -> :class:`EngineRequestError` (message and status kept)."""
    status = getattr(exc, "status_code", None)  # fastapi.HTTPException (tokenizer_manager.py:1919)
    detail = getattr(exc, "detail", None)
    if status is not None:
        return EngineRequestError(str(detail if detail is not None else exc), status_code=int(status), rid=rid)
    if isinstance(exc, ValueError):  # 400 aborts (:1917-1918) and tokenizer-manager validation
        return EngineRequestError(str(exc), status_code=400, rid=rid)
    return EngineRequestError(f"{type(exc).__name__}: {exc}", rid=rid)


def _update_result(result: Any) -> tuple[bool, str]:
    """``(success, message, num_paused_requests)`` (0.5.23), ``(success, message)``, or an object."""
    if isinstance(result, tuple):
        success = bool(result[0]) if result else False
        message = str(result[1]) if len(result) > 1 else ""
        return success, message
    if hasattr(result, "success"):
        return bool(result.success), str(getattr(result, "message", ""))
    return bool(result), ""


__all__ = ["ENGINE_NAME", "EngineCommandRefused", "EngineRequestError", "SGLANG_VERSION", "SGLangEngine",
           "WeightUpdateError"]
