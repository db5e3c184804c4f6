"""The SGLang 0.5.x adapter: the Engine protocol on an in-process ``sglang.Engine``.

sglang is imported lazily inside :meth:`SGLangEngine.start` (and the io_struct classes inside the
weight/memory calls), so importing this module needs neither sglang nor torch.

What the adapter relies on, and where in sglang (sgl-project/sglang, ``python/sglang/srt/``) it was
checked (0.5.x sources; commits read: entrypoints/engine.py 001067ff (main, 0.5.x line) and 18bfdd16
(0.4.x, for contrast), the 0.5.x tokenizer_manager.py / io_struct.py / scheduler.py /
schedule_batch.py versions quoted next to each use below):

* ``Engine.async_generate(prompt=..., input_ids=..., sampling_params=..., return_logprob=..., lora_path=...,
  rid=...)`` returns one dict ``{"text"?, "output_ids", "meta_info"}`` for a single request
  (entrypoints/engine.py ``Engine.async_generate`` -> tokenizer_manager.py ``generate_request``).
* ``n > 1`` inside SGLang is NOT used: io_struct.py ``GenerateReqInput._handle_parallel_sampling`` turns
  the request into a batch, and tokenizer_manager.py ``_handle_batch_request`` gives every sample a
  fresh ``regenerate_rid()`` uuid that the caller never sees, so such samples cannot be aborted by rid.
  Instead every sample is its own ``async_generate`` call with its own rid.
* rids: ``scheduler.py Scheduler.abort_request`` matches ``req.rid.startswith(recv_req.rid)`` (a PREFIX
  match, also for running requests), so no live rid may be a prefix of another: every rid here is
  ``rr-<8 hex per engine>-<12-digit counter>-<fixed-width sample index>``, all bases of one engine of
  equal length. (The worker's handle ``<entry_id>.<deliveries>`` is not prefix-free: ``X.1`` vs ``X.10``.)
* ``tokenizer_manager.py TokenizerManager.abort_request(rid="", abort_all=False)`` silently ignores a rid
  that is not (yet) in ``rid_to_state``, and an abort that reaches the scheduler before the request
  does (while it is being tokenized) finds nothing: aborts are therefore re-sent until the sample's
  call returns (:meth:`SGLangEngine._reabort_loop`).
* Finish reasons (schedule_batch.py ``FINISH_MATCHED_TOKEN/FINISH_MATCHED_STR/FINISH_LENGTH/FINISH_ABORT
  .to_json``): ``{"type": "stop"|"length"|"abort", ...}``; an abort carries ``message``, ``status_code``
  and ``err_type``; ``status_code`` is None for a requested abort (``FINISH_ABORT()``).
* Abort shapes: in the waiting queue (tokenizer_manager.py ``_handle_abort_req``): empty ``output_ids``,
  ``meta_info`` without ``prompt_tokens``/``cached_tokens``; while running (``_handle_batch_output``):
  the partial ``output_ids`` and ``output_token_logprobs`` plus the usual counters.
* Error aborts (tokenizer_manager.py ``_wait_one_response``): status 400 -> ``raise ValueError(message)``;
  503/500 -> ``raise fastapi.HTTPException(status_code, detail=message)``; validation in
  ``_validate_one_request`` raises ``ValueError`` before the scheduler sees the request; later 0.5.x
  ``_init_req_state`` raises ``ValueError(f"Duplicate request ID detected: {rid}")``. All of these
  become :class:`EngineRequestError` (the worker hands the request back; dead-letter after
  ``max_deliveries``), unless we had asked for the abort, in which case the sample ends "abort". So
  does an abort we did not ask for (e.g. ``abort_all`` from ``pause_generation``).
* Weights and memory (tokenizer_manager.py ``update_weights_from_disk(obj, request)`` ->
  ``(success, message, num_paused_requests)``, ``release_memory_occupation(obj, request)``,
  ``resume_memory_occupation(obj, request)``; io_struct.py ``UpdateWeightFromDiskReqInput(model_path,
  load_format, abort_all_requests, weight_version, ...)``, ``Release/ResumeMemoryOccupationReqInput(tags)``)
  are awaited on the tokenizer manager: the ``Engine`` wrappers call ``self.loop.run_until_complete``
  (entrypoints/engine.py ``Engine.update_weights_from_disk``) and fail inside a running loop.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import importlib
import inspect
import itertools
import logging
import secrets
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from redroll.shared.codec import ValidationError
from redroll.shared.types import GenerationRequest

from .base import EngineInfo, EngineOutput, SampleOutput, check_token_ids

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


@dataclass(eq=False)
class _Job:
    """One ``generate`` call: n samples, each its own SGLang request."""

    handle: str
    rids: list[str]
    aborted: bool = False
    live: set[str] = field(default_factory=set)
    """rids whose ``async_generate`` call is in flight."""
    reabort_task: asyncio.Task | None = None


@dataclass
class _Sample:
    output: SampleOutput
    prompt_tokens: int | None = None
    cached_tokens: int = 0
    weight_version: str | None = None
    e2e_latency: float | None = None


class SGLangEngine:
    """Engine protocol on ``sglang.Engine`` (0.5.x), in this process and event loop."""

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
    ) -> None:
        self.model_path = model_path
        self.loaded_model_path = model_path
        """The weights last loaded (``update_weights_from_disk`` changes it; ``info.model`` stays)."""
        self.skip_tokenizer_init = skip_tokenizer_init
        self._weight_version = weight_version
        self._engine_factory = engine_factory
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
        # Only what is set, so ServerArgs' own defaults apply to the rest
        # (entrypoints/engine.py Engine.__init__: ServerArgs(**kwargs)).
        self._engine_kwargs: dict[str, Any] = {"model_path": model_path}
        self._engine_kwargs.update({k: v for k, v in named.items() if v is not None})
        self._engine_kwargs.update(extra)

        self.info = EngineInfo(name=ENGINE_NAME, model=model_path, weight_version=weight_version or "0",
                               max_context=context_length)
        self.engine: Any = None
        self.tokenizer: Any = None
        self.server_args: Any = None
        self._max_req_input_len: int | None = None
        self._jobs: dict[str, _Job] = {}
        self._aborted: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._rid_prefix = f"rr-{secrets.token_hex(4)}-"
        self._seq = itertools.count(1)
        self.abort_retry_s = 0.05
        """First re-send interval for aborts that SGLang may not have taken yet (doubles up to 1 s)."""

    # ------------------------------------------------------------------ lifecycle

    def engine_kwargs(self) -> dict[str, Any]:
        """The keyword arguments ``start()`` passes to ``sglang.Engine`` (ServerArgs names)."""
        return dict(self._engine_kwargs)

    async def start(self) -> None:
        """Build the engine in the running event loop and read what it knows about the model.

        ``sglang.Engine.__init__`` launches the scheduler/detokenizer processes and blocks until they
        are ready; it is called here, on the loop, because the tokenizer manager's asyncio state binds
        to the loop it is first used on (tokenizer_manager.py ``auto_create_handle_loop``).
        """
        if self.engine is not None:
            return
        factory = self._engine_factory
        if factory is None:
            import sglang  # lazy: the queue core must import without it

            factory = sglang.Engine
        engine = factory(**self.engine_kwargs())
        _require_rid_parameter(engine)
        self.engine = engine
        self._fill_info()

    def _fill_info(self) -> None:
        engine = self.engine
        tm = getattr(engine, "tokenizer_manager", None)
        model_config = getattr(tm, "model_config", None)
        self.server_args = getattr(engine, "server_args", None) or getattr(tm, "server_args", None)
        self.tokenizer = getattr(tm, "tokenizer", None)
        vocab = getattr(model_config, "vocab_size", None)
        context = getattr(tm, "context_len", None) or getattr(model_config, "context_len", None)
        self.info.vocab_size = int(vocab) if vocab else None
        self.info.max_context = int(context) if context else self.info.max_context
        max_input = getattr(tm, "max_req_input_len", None)  # set by engine.py from the scheduler
        self._max_req_input_len = int(max_input) if isinstance(max_input, int) else None
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
        server_version = getattr(self.server_args, "weight_version", None)  # server_args.py: "default"
        self.info.weight_version = self._weight_version or server_version or "0"

    async def close(self, timeout_s: float = 5.0) -> None:
        """Abort what is in flight, give it ``timeout_s`` to return, and shut the engine down."""
        for job in list(self._jobs.values()):
            self._abort_job(job)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._jobs and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        engine, self.engine = self.engine, None
        if engine is not None and hasattr(engine, "shutdown"):
            engine.shutdown()

    def _require_engine(self) -> Any:
        if self.engine is None:
            raise RuntimeError("SGLangEngine.start() has not been called (or the engine was closed)")
        return self.engine

    # ------------------------------------------------------------------ validation

    def validate(self, request: GenerationRequest) -> None:
        """Refuse what SGLang would refuse, so it is dead-lettered at once instead of retried."""
        check_token_ids(request, self.info.vocab_size, self.info.max_context)
        if request.prompt is not None and request.input_ids is None and self._started_without_tokenizer():
            # tokenizer_manager.py _tokenize_one_request: "The engine initialized with
            # skip_tokenizer_init=True cannot accept text prompts."
            raise ValidationError("prompt", "this SGLang engine runs with skip_tokenizer_init: send input_ids")
        if request.input_ids is not None and not request.input_ids:
            raise ValidationError("input_ids", "must not be empty")  # io_struct.py _determine_batch_size
        if request.lora_path is not None and self.server_args is not None and not getattr(
                self.server_args, "enable_lora", None):
            raise ValidationError("lora_path", "LoRA is not enabled on this SGLang engine (start it with lora_paths)")
        prompt_len = self._prompt_len(request)
        if prompt_len is None:
            return
        context = self.info.max_context
        max_new = request.sampling_params.max_new_tokens
        field_name = "input_ids" if request.input_ids is not None else "prompt"
        # tokenizer_manager.py _validate_one_request: both limits are ">=", not ">".
        if context is not None and prompt_len >= context:
            raise ValidationError(field_name, f"the input ({prompt_len} tokens) is longer than the model's "
                                              f"context length ({context} tokens)")
        if context is not None and prompt_len + max_new >= context:
            raise ValidationError("sampling_params.max_new_tokens",
                                  f"prompt ({prompt_len}) + max_new_tokens ({max_new}) reaches the model's "
                                  f"context length of {context} tokens")
        # managers/utils.py validate_input_length (scheduler): a 400 abort otherwise.
        if self._max_req_input_len is not None and prompt_len >= self._max_req_input_len:
            raise ValidationError(field_name, f"input length ({prompt_len} tokens) exceeds the engine's maximum "
                                              f"allowed length ({self._max_req_input_len} tokens)")

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
        job = _Job(handle, [f"{base}-{i:0{width}d}" for i in range(n)])
        if handle in self._aborted:
            del self._aborted[handle]
            job.aborted = True  # aborted before it started: start nothing
        self._jobs[handle] = job
        tasks = [asyncio.ensure_future(self._run_sample(engine, job, request, i)) for i in range(n)]
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
            if job.reabort_task is not None:
                job.reabort_task.cancel()
        return self._engine_output(request, samples)

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
        self._send_aborts(job)
        if job.live and (job.reabort_task is None or job.reabort_task.done()):
            job.reabort_task = asyncio.get_running_loop().create_task(
                self._reabort_loop(job), name=f"sglang-reabort-{job.handle}")

    def _send_aborts(self, job: _Job) -> None:
        engine = self.engine
        if engine is None:
            return
        for rid in sorted(job.live):
            try:
                # tokenizer_manager.py abort_request(rid="", abort_all=False): exact rid, never abort_all.
                engine.tokenizer_manager.abort_request(rid)
            except Exception:  # pragma: no cover - SGLang-side failure; the re-send loop retries
                log.exception("abort_request(%s) failed", rid)

    async def _reabort_loop(self, job: _Job) -> None:
        """Re-send aborts while samples are live: SGLang drops an abort that arrives before the
        request is in ``rid_to_state`` or in the scheduler (tokenizer_manager.py ``abort_request``)."""
        delay = self.abort_retry_s
        try:
            while job.live:
                await asyncio.sleep(delay)
                if not job.live:
                    return
                self._send_aborts(job)
                delay = min(delay * 2, 1.0)
        except asyncio.CancelledError:
            pass

    async def _run_sample(self, engine: Any, job: _Job, request: GenerationRequest, index: int) -> _Sample:
        rid = job.rids[index]
        if job.aborted:
            return self._never_started(request)
        sampling = request.sampling_params.engine_kwargs()  # a fresh dict: SGLang may edit it in place
        if request.sampling_params.sampling_seed is not None:
            # Separate requests with one seed would sample identical sequences: seed + index, as the
            # transformers engine does.
            sampling["sampling_seed"] = request.sampling_params.sampling_seed + index
        kwargs: dict[str, Any] = {"sampling_params": sampling, "return_logprob": request.return_logprob, "rid": rid}
        if request.input_ids is not None:
            kwargs["input_ids"] = list(request.input_ids)
        else:
            kwargs["prompt"] = request.prompt
        if request.lora_path is not None:
            kwargs["lora_path"] = request.lora_path
        job.live.add(rid)
        try:
            out = await engine.async_generate(**kwargs)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if job.aborted:
                log.debug("sample %s raised after our abort (%s); reporting it aborted", rid, exc)
                return self._never_started(request)
            raise _request_error(exc, rid) from exc
        finally:
            job.live.discard(rid)
        return self._map_output(out, job, request, rid)

    # ------------------------------------------------------------------ output mapping

    def _map_output(self, out: Any, job: _Job, request: GenerationRequest, rid: str) -> _Sample:
        if not isinstance(out, dict):
            raise EngineRequestError(f"SGLang returned {type(out).__name__} for rid {rid}, expected one dict "
                                     "(was n passed to SGLang?)", rid=rid)
        meta = out.get("meta_info") or {}
        finish = meta.get("finish_reason")
        reason = _finish_type(finish)
        if reason == "abort" and not job.aborted:
            # Not our abort: an error abort SGLang returned instead of raising (a status other than
            # 400/500/503), or an abort from elsewhere (abort_all by pause_generation or by a weight
            # update with abort_all_requests). Nobody asked to abort this request: retry it.
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
            entries = meta.get("output_token_logprobs") or []
            if len(entries) != len(token_ids) or any(
                    e[1] is not None and int(e[1]) != t for e, t in zip(entries, token_ids)):
                raise EngineRequestError(f"SGLang's output_token_logprobs ({len(entries)}) do not line up with "
                                         f"output_ids ({len(token_ids)}) for rid {rid}", rid=rid)
            logprobs = [float(e[0]) for e in entries]
        prompt_tokens = meta.get("prompt_tokens")
        latency = meta.get("e2e_latency")
        return _Sample(
            output=SampleOutput(token_ids=token_ids, logprobs=logprobs, finish_reason=reason),
            prompt_tokens=int(prompt_tokens) if prompt_tokens is not None else None,
            cached_tokens=int(meta.get("cached_tokens") or 0),
            weight_version=meta.get("weight_version"),
            e2e_latency=float(latency) if latency is not None else None,
        )

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
        return EngineOutput(
            samples=[s.output for s in samples],
            prompt_tokens=prompt_tokens,
            cached_tokens=sum(s.cached_tokens for s in samples),
            weight_version=str(versions[0]) if versions else self.info.weight_version,
            extra=extra,
        )

    # ------------------------------------------------------------------ weights and memory

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                       load_format: str | None = None) -> str:
        """Load new weights in place; returns SGLang's message, raises :class:`WeightUpdateError`.

        SGLang waits for the requests in flight (tokenizer_manager.py ``update_weights_from_disk`` takes
        ``model_update_lock.writer_lock``; every generate_request holds the reader lock).
        """
        engine = self._require_engine()
        cls = self._io_class("UpdateWeightFromDiskReqInput")
        kwargs: dict[str, Any] = {"model_path": model_path, "load_format": load_format}
        if weight_version is not None:
            if dataclasses.is_dataclass(cls) and "weight_version" not in {f.name for f in dataclasses.fields(cls)}:
                raise WeightUpdateError("this SGLang's UpdateWeightFromDiskReqInput has no weight_version field")
            kwargs["weight_version"] = weight_version
        result = await engine.tokenizer_manager.update_weights_from_disk(cls(**kwargs), None)
        success, message = _update_result(result)
        if not success:
            raise WeightUpdateError(f"update_weights_from_disk({model_path!r}) failed: {message}")
        self.loaded_model_path = model_path
        server_version = getattr(self.server_args, "weight_version", None)
        self.info.weight_version = weight_version or server_version or self.info.weight_version
        return message

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free GPU memory (weights and/or KV cache) until :meth:`resume_memory_occupation`."""
        engine = self._require_engine()
        cls = self._io_class("ReleaseMemoryOccupationReqInput")
        await engine.tokenizer_manager.release_memory_occupation(cls(tags=tags) if tags is not None else cls(), None)

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        engine = self._require_engine()
        cls = self._io_class("ResumeMemoryOccupationReqInput")
        await engine.tokenizer_manager.resume_memory_occupation(cls(tags=tags) if tags is not None else cls(), None)

    def _io_class(self, name: str) -> type:
        """An io_struct class: from the engine factory (its ``io_struct`` attribute or its module, the
        seam for stand-ins), else from ``sglang.srt.managers.io_struct``."""
        factory = self._engine_factory
        if factory is not None:
            source = getattr(factory, "io_struct", None)
            if source is not None and hasattr(source, name):
                return getattr(source, name)
            module_name = getattr(factory, "__module__", None) or getattr(
                getattr(factory, "func", None), "__module__", None)
            module = sys.modules.get(module_name) if module_name else None
            if module is not None and hasattr(module, name):
                return getattr(module, name)
        io_struct = importlib.import_module("sglang.srt.managers.io_struct")
        return getattr(io_struct, name)


# ---------------------------------------------------------------------- helpers


def _require_rid_parameter(engine: Any) -> None:
    """Per-sample rids need ``async_generate(rid=...)`` (entrypoints/engine.py, 0.5.x; absent in 0.4.x)."""
    try:
        parameters = inspect.signature(engine.async_generate).parameters
    except (TypeError, ValueError, AttributeError):
        return
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    if "rid" not in parameters and not accepts_any:
        if hasattr(engine, "shutdown"):
            engine.shutdown()
        raise RuntimeError("this sglang's Engine.async_generate has no rid parameter; redroll needs sglang>=0.5")


def _finish_type(finish: Any) -> str | None:
    if isinstance(finish, dict):
        value = finish.get("type")
        return str(value) if value is not None else None
    if isinstance(finish, str):
        return finish
    return None


def _request_error(exc: BaseException, rid: str) -> EngineRequestError:
    """SGLang's exceptions for one request -> :class:`EngineRequestError` (message and status kept)."""
    status = getattr(exc, "status_code", None)  # fastapi.HTTPException from _wait_one_response
    detail = getattr(exc, "detail", None)
    if status is not None:
        return EngineRequestError(str(detail if detail is not None else exc), status_code=int(status), rid=rid)
    if isinstance(exc, ValueError):  # 400 aborts and tokenizer-manager validation
        return EngineRequestError(str(exc), status_code=400, rid=rid)
    return EngineRequestError(f"{type(exc).__name__}: {exc}", rid=rid)


def _update_result(result: Any) -> tuple[bool, str]:
    """``(success, message, num_paused_requests)`` (0.5.x), ``(success, message)`` (older), or an object."""
    if isinstance(result, tuple):
        success = bool(result[0]) if result else False
        message = str(result[1]) if len(result) > 1 else ""
        return success, message
    if hasattr(result, "success"):
        return bool(result.success), str(getattr(result, "message", ""))
    return bool(result), ""


__all__ = ["ENGINE_NAME", "EngineRequestError", "SGLangEngine", "WeightUpdateError"]
