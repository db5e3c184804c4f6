"""A stand-in for SGLang 0.5.x's offline ``sglang.Engine``, for testing the redroll adapter without a GPU.

It reproduces the *contract* the adapter depends on - call signatures, output dict shapes, finish
reasons, exceptions and their messages, the abort semantics and their races - not the model. Every
behaviour below names the SGLang source it was checked against (files under ``python/sglang/srt/``
of sgl-project/sglang, read through the stored-source search tools):

* ``entrypoints/engine.py`` ``Engine.__init__`` / ``Engine.async_generate`` / ``Engine.update_weights_from_disk``
  (0.5.x; the stored 0.4.x commit 18bfdd16 lacks ``rid`` on ``async_generate``, the 0.5.x/main one,
  commit 001067ff, has it): the engine builds ``ServerArgs(**kwargs)`` (``log_level="error"`` unless
  given); ``async_generate`` wraps its arguments into a ``GenerateReqInput`` and returns
  ``await tokenizer_manager.generate_request(obj, None).__anext__()``; the *sync* wrappers
  (``update_weights_from_disk``, ``release_memory_occupation``, ``get_server_info``, ...) call
  ``self.loop.run_until_complete(...)`` and therefore fail inside a running event loop.
* ``managers/io_struct.py`` (0.5.x): ``GenerateReqInput.normalize_batch_and_arguments`` /
  ``_handle_parallel_sampling`` (``n > 1`` turns a single request into a batch) / ``_normalize_rid``
  (a string rid ``X`` becomes ``X_0 .. X_{k-1}``); ``BaseReq.regenerate_rid`` (``uuid4().hex``);
  ``UpdateWeightFromDiskReqInput`` (model_path, load_format, abort_all_requests, weight_version,
  is_async, torch_empty_cache, keep_pause, recapture_cuda_graph, token_step, + flush_cache on
  later 0.5.x); ``Release/ResumeMemoryOccupationReqInput(tags)``; ``AbortReq(abort_all,
  finished_reason, abort_message)`` with ``rid`` defaulting to ``""``.
* ``managers/tokenizer_manager.py`` (0.5.x): ``generate_request`` (holds ``model_update_lock.reader_lock``
  for the whole request), ``_init_req_state`` (later 0.5.x: ``ValueError(f"Duplicate request ID
  detected: {rid}")`` for a live rid; earlier 0.5.x silently overwrote the state),
  ``_validate_one_request`` (context-length ``ValueError`` messages), ``_wait_one_response`` (an abort
  with ``status_code == 400`` raises ``ValueError(message)``; with 503/500 raises
  ``fastapi.HTTPException(status_code, detail=message)``; any other finish is returned),
  ``_handle_batch_request`` (``n > 1``: one prefix-caching request with ``max_new_tokens = 0``, then
  ``n`` copies, each with a fresh ``regenerate_rid()`` uuid, the list of ``n`` dicts is returned),
  ``abort_request(rid="", abort_all=False)`` (ignores an empty rid and any rid not in
  ``rid_to_state``), ``_handle_batch_output`` (``meta_info`` keys: id, finish_reason, prompt_tokens,
  weight_version, total_retractions, completion_tokens, cached_tokens, output_token_logprobs when
  asked, e2e_latency when finished; ``output_ids`` always, ``text`` unless ``skip_tokenizer_init``),
  ``detokenize_logprob_tokens`` (tuples ``(logprob, token_id, None)`` unless text was requested),
  ``_handle_abort_req`` (abort in the waiting queue: finish_reason ``{"type": "abort", "message":
  "Abort in waiting queue"}`` or the scheduler's ``finished_reason``; meta_info has id,
  finish_reason, weight_version, e2e_latency, completion_tokens - *no* prompt_tokens/cached_tokens;
  ``text`` and empty ``output_ids``), ``update_weights_from_disk(obj, request)`` returning
  ``(success, message, num_paused_requests)`` and updating ``server_args.weight_version`` when
  ``obj.weight_version`` is set, ``TokenizerCommunicatorMixin.release/resume_memory_occupation(obj,
  request=None)`` returning ``None``.
* ``managers/scheduler.py`` (0.5.x): ``Scheduler.abort_request`` matches by PREFIX
  (``req.rid.startswith(recv_req.rid)``) in the waiting queue (popped, ``AbortReq(rid)`` sent back
  to the tokenizer manager) and in the running batch (``req.to_finish = FINISH_ABORT()``: "the
  request will still run one decode forward pass"); ``_abort_on_queued_limit`` (``--max-queued-requests``:
  ``finished_reason={"type": "abort", "status_code": 503, "message": "The request queue is full."}``);
  ``managers/utils.py`` ``validate_input_length`` (``"Input length (N tokens) exceeds the maximum
  allowed length (M tokens). Use a shorter input or enable --allow-auto-truncate."`` -> 400 abort).
* ``managers/schedule_batch.py``: ``FINISH_MATCHED_TOKEN/STR.to_json() == {"type": "stop", "matched":
  ...}``, ``FINISH_LENGTH.to_json() == {"type": "length", "length": n}``, ``FINISH_ABORT(message or
  "Aborted", status_code, err_type).to_json()``; ``Req.set_finish_with_abort`` (400,
  "BadRequestError"); ``Req.check_finished`` order: to_finish, length, stop tokens/eos, stop strings.
* ``server_args.py``: ``weight_version: str = "default"``.

Simplifications (documented, not part of the adapter's contract): a byte-level toy tokenizer;
deterministic tokens and logprobs instead of a model; a toy prefix cache for ``cached_tokens``;
``input_token_logprobs`` always empty; one tick of the scheduler loop is one forward pass for every
running request; streaming, multimodal and batch (list) inputs are not modelled.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import hashlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Union

log = logging.getLogger("tests.sglang_standin")

try:  # the real code raises fastapi.HTTPException (tokenizer_manager.py ``_wait_one_response``)
    from fastapi import HTTPException
except ImportError:  # pragma: no cover - depends on the environment

    class HTTPException(Exception):  # type: ignore[no-redef]
        """Same constructor and attributes as ``fastapi.HTTPException`` (starlette's)."""

        def __init__(self, status_code: int, detail: Any = None, headers: Optional[dict] = None) -> None:
            self.status_code = status_code
            self.detail = detail if detail is not None else HTTPStatus(status_code).phrase
            self.headers = headers
            super().__init__(status_code, self.detail)

        def __str__(self) -> str:
            return f"{self.status_code}: {self.detail}"


# ----------------------------------------------------------------------------- io_struct look-alikes
# Same class names and field names as sglang/srt/managers/io_struct.py (0.5.x), so the adapter can
# build them from this module exactly as it does from the real one.


@dataclass
class BaseReq:
    rid: Optional[Union[str, List[str]]] = field(default=None, kw_only=True)
    http_worker_ipc: Optional[str] = field(default=None, kw_only=True)

    def regenerate_rid(self):
        """io_struct.py ``BaseReq.regenerate_rid``: a fresh ``uuid4().hex``."""
        if isinstance(self.rid, list):
            self.rid = [uuid.uuid4().hex for _ in range(len(self.rid))]
        else:
            self.rid = uuid.uuid4().hex
        return self.rid


@dataclass
class GenerateReqInput(BaseReq):
    """The fields of io_struct.py ``GenerateReqInput`` that the stand-in models."""

    text: Optional[Union[List[str], str]] = None
    input_ids: Optional[Union[List[List[int]], List[int]]] = None
    sampling_params: Optional[Union[List[Dict], Dict]] = None
    return_logprob: Optional[Union[List[bool], bool]] = None
    logprob_start_len: Optional[Union[List[int], int]] = None
    top_logprobs_num: Optional[Union[List[int], int]] = None
    token_ids_logprob: Optional[Union[List[List[int]], List[int]]] = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    lora_path: Optional[Union[List[Optional[str]], Optional[str]]] = None
    custom_logit_processor: Optional[Union[List[Optional[str]], str]] = None
    data_parallel_rank: Optional[int] = None

    def normalize_batch_and_arguments(self) -> None:
        """io_struct.py ``normalize_batch_and_arguments`` for single text / single input_ids inputs."""
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("Either text, input_ids or input_embeds should be provided.")
        if self.input_ids is not None and len(self.input_ids) == 0:
            raise ValueError("input_ids cannot be empty.")
        if isinstance(self.text, list) or (self.input_ids is not None and not isinstance(self.input_ids[0], int)):
            raise NotImplementedError("stand-in: batch (list) inputs are not modelled")
        self.is_single = True
        self.batch_size = 1
        # _handle_parallel_sampling
        if self.sampling_params is None:
            self.parallel_sample_num = 1
        else:
            self.parallel_sample_num = self.sampling_params.get("n", 1)
        if self.parallel_sample_num > 1:
            # "If using parallel sampling with a single example, convert to batch"
            self.is_single = False
            if self.text is not None:
                self.text = [self.text]
            if self.input_ids is not None:
                self.input_ids = [self.input_ids]
        if self.is_single:
            # _normalize_single_inputs
            if self.sampling_params is None:
                self.sampling_params = {}
            if self.rid is None:
                self.rid = uuid.uuid4().hex
            if self.return_logprob is None:
                self.return_logprob = False
            if self.logprob_start_len is None:
                self.logprob_start_len = -1
            if self.top_logprobs_num is None:
                self.top_logprobs_num = 0
        else:
            # _normalize_batch_inputs: num = batch_size * parallel_sample_num
            num = self.batch_size * self.parallel_sample_num
            if self.text is not None:
                self.text = self.text * self.parallel_sample_num
            if self.input_ids is not None:
                self.input_ids = self.input_ids * self.parallel_sample_num
            # _normalize_rid: a string rid X becomes [X_0, ..., X_{num-1}]
            if self.rid is None:
                self.rid = [uuid.uuid4().hex for _ in range(num)]
            elif isinstance(self.rid, str):
                self.rid = [f"{self.rid}_{i}" for i in range(num)]
            self.sampling_params = [self.sampling_params] * num
            self.return_logprob = [bool(self.return_logprob)] * num
            self.lora_path = [self.lora_path] * num

    def __getitem__(self, i: int) -> "GenerateReqInput":
        return GenerateReqInput(
            text=self.text[i] if self.text is not None else None,
            input_ids=self.input_ids[i] if self.input_ids is not None else None,
            sampling_params=self.sampling_params[i],
            rid=self.rid[i],
            return_logprob=self.return_logprob[i],
            logprob_start_len=-1,
            top_logprobs_num=0,
            stream=self.stream,
            lora_path=self.lora_path[i] if self.lora_path is not None else None,
        )


@dataclass
class UpdateWeightFromDiskReqInput(BaseReq):
    model_path: str
    load_format: Optional[str] = None
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True


@dataclass
class UpdateWeightFromDiskReqOutput(BaseReq):
    success: bool
    message: str
    num_paused_requests: Optional[int] = 0


@dataclass
class ReleaseMemoryOccupationReqInput(BaseReq):
    tags: Optional[List[str]] = None


@dataclass
class ResumeMemoryOccupationReqInput(BaseReq):
    tags: Optional[List[str]] = None


@dataclass
class AbortReq(BaseReq):
    abort_all: bool = False
    finished_reason: Optional[Dict[str, Any]] = None
    abort_message: Optional[str] = None

    def __post_init__(self) -> None:
        if self.rid is None:  # io_struct.py: "keep the same with the old code"
            self.rid = ""


# ----------------------------------------------------------------------------- finish reasons
# schedule_batch.py BaseFinishReason subclasses and their to_json().


class BaseFinishReason:
    def __init__(self, is_error: bool = False) -> None:
        self.is_error = is_error


class FINISH_MATCHED_TOKEN(BaseFinishReason):
    def __init__(self, matched: Union[int, List[int]]) -> None:
        super().__init__()
        self.matched = matched

    def to_json(self) -> dict:
        return {"type": "stop", "matched": self.matched}


class FINISH_MATCHED_STR(BaseFinishReason):
    def __init__(self, matched: str) -> None:
        super().__init__()
        self.matched = matched

    def to_json(self) -> dict:
        return {"type": "stop", "matched": self.matched}


class FINISH_LENGTH(BaseFinishReason):
    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length

    def to_json(self) -> dict:
        return {"type": "length", "length": self.length}


class FINISH_ABORT(BaseFinishReason):
    def __init__(self, message: Optional[str] = None, status_code: Optional[int] = None,
                 err_type: Optional[str] = None) -> None:
        super().__init__(is_error=True)
        self.message = message or "Aborted"
        self.status_code = status_code
        self.err_type = err_type

    def to_json(self) -> dict:
        return {"type": "abort", "message": self.message, "status_code": self.status_code,
                "err_type": self.err_type}


# ----------------------------------------------------------------------------- sampling params
# sampling/sampling_params.py SamplingParams.__init__ keyword names (0.5.x): an unknown key is a
# TypeError, as in the real ``SamplingParams(**sampling_kwargs)`` (tokenizer_manager
# ``_create_tokenized_object``).
SAMPLING_PARAM_NAMES = frozenset({
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "custom_params", "stream_interval", "logit_bias", "sampling_seed",
})


def _check_sampling_params(params: Dict[str, Any]) -> None:
    unknown = sorted(set(params) - SAMPLING_PARAM_NAMES)
    if unknown:
        raise TypeError(f"SamplingParams.__init__() got an unexpected keyword argument '{unknown[0]}'")


# ----------------------------------------------------------------------------- toy model pieces


class StandInTokenizer:
    """Byte-level toy tokenizer: ids 0/1/2 are pad/bos/eos, byte b is id b + 3."""

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        return [b + 3 for b in text.encode("utf-8")]

    def __call__(self, texts: List[str], **_: Any) -> Dict[str, List[List[int]]]:
        return {"input_ids": [self.encode(t) for t in texts]}

    def decode(self, ids: List[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", errors="replace")

    def batch_decode(self, ids: List[int]) -> List[str]:
        return [self.decode([i]) for i in ids]


@dataclass
class StandInOptions:
    """Knobs of the stand-in (not SGLang arguments)."""

    token_delay_s: float = 0.002
    """Time of one forward pass (one token for every running request)."""
    tokenize_delay_s: float = 0.0
    """Time between registering a request's state and handing it to the scheduler (tokenization):
    an abort in this window reaches a scheduler that does not hold the request yet, and is lost."""
    vocab_size: int = 1000
    model_context_len: int = 4096
    max_req_input_len: Optional[int] = None
    """The scheduler's input limit (engine.py sets it from the scheduler); default context_len - 1."""
    token_fn: Optional[Callable[[List[int], int, Any, int], int]] = None
    """(prompt ids, position, seed, vocab) -> token. Default: a hash that never yields 0, 1 or 2."""
    inject_error: Optional[Callable[[str], Optional[tuple]]] = None
    """rid -> (status_code, message) to make the scheduler abort that request with an error."""
    bad_weight_paths: frozenset = frozenset()
    """update_weights_from_disk fails for these model paths."""


def default_token_fn(prompt_ids: List[int], position: int, seed: Any, vocab: int) -> int:
    digest = hashlib.blake2b(f"{tuple(prompt_ids)}|{seed}|{position}".encode(), digest_size=8).digest()
    return 3 + int.from_bytes(digest, "big") % (vocab - 3)


def token_logprob(token: int, position: int) -> float:
    return -round(((token * 2654435761 + position * 97) % 1000) / 250.0 + 0.001, 6)


# ----------------------------------------------------------------------------- scheduler


class _Req:
    """schedule_batch.py ``Req`` (the fields the stand-in needs)."""

    def __init__(self, rid: str, input_ids: List[int], sampling_params: Dict[str, Any], return_logprob: bool,
                 lora_path: Optional[str], cached_tokens: int) -> None:
        self.rid = rid
        self.origin_input_ids = list(input_ids)
        self.prompt_ids = list(input_ids)
        self.sampling_params = dict(sampling_params)
        self.return_logprob = return_logprob
        self.lora_path = lora_path
        self.cached_tokens = cached_tokens
        self.output_ids: List[int] = []
        self.output_logprobs: List[float] = []
        self.finished_reason: Optional[BaseFinishReason] = None
        self.to_finish: Optional[BaseFinishReason] = None

    def finished(self) -> bool:
        return self.finished_reason is not None

    def set_finish_with_abort(self, error_msg: str) -> None:
        """schedule_batch.py ``Req.set_finish_with_abort``."""
        self.origin_input_ids = [0]  # "set it to one token to skip the long prefill"
        self.return_logprob = False
        self.to_finish = FINISH_ABORT(error_msg, HTTPStatus.BAD_REQUEST, "BadRequestError")

    def check_finished(self, tokenizer: Optional[StandInTokenizer], eos_ids: set) -> None:
        """schedule_batch.py ``Req.check_finished``: to_finish, then length, then stop tokens, then strings."""
        if self.finished():
            return
        if self.to_finish:
            self.finished_reason = self.to_finish
            self.to_finish = None
            return
        sp = self.sampling_params
        max_new = sp.get("max_new_tokens", 128)
        if len(self.output_ids) >= max_new:
            self.finished_reason = FINISH_LENGTH(length=max_new)
            return
        if len(self.output_ids) < sp.get("min_new_tokens", 0):
            return  # stops are masked before min_new_tokens
        last = self.output_ids[-1]
        stop_ids = set(sp.get("stop_token_ids") or ())
        if last in stop_ids or (not sp.get("ignore_eos", False) and last in eos_ids):
            self.finished_reason = FINISH_MATCHED_TOKEN(matched=last)
            return
        stops = sp.get("stop") or ()
        if isinstance(stops, str):
            stops = [stops]
        if stops and tokenizer is not None:
            text = tokenizer.decode(self.output_ids)
            for stop in stops:
                if stop in text:
                    self.finished_reason = FINISH_MATCHED_STR(matched=stop)
                    return


class StandInScheduler:
    """The scheduler's event loop: inbox, waiting queue, running batch, one token per tick."""

    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self.options: StandInOptions = engine.standin_options
        self.server_args = engine.server_args
        self.waiting_queue: List[_Req] = []
        self.running: List[_Req] = []
        self.inbox: List[Any] = []
        self.max_running_requests = self.server_args.max_running_requests
        self.max_queued_requests = getattr(self.server_args, "max_queued_requests", None)
        self.forward_passes = 0
        self.aborts_received: List[AbortReq] = []
        self._wake = asyncio.Event()
        self._seen_prompts: List[tuple] = []

    def send(self, obj: Any) -> None:
        """``send_to_scheduler.send_pyobj``: processed at the top of the next loop iteration."""
        self.inbox.append(obj)
        self._wake.set()

    async def run(self) -> None:
        try:
            while True:
                if not (self.inbox or self.waiting_queue or self.running):
                    self._wake.clear()
                    await self._wake.wait()
                self._process_inbox()
                self._admit()
                if self.running:
                    await asyncio.sleep(self.options.token_delay_s)  # the forward pass
                    self._forward()
                else:
                    await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except Exception:  # pragma: no cover - a stand-in bug; make it loud
            log.exception("stand-in scheduler crashed")
            raise

    # -- inputs

    def _process_inbox(self) -> None:
        inbox, self.inbox = self.inbox, []
        for obj in inbox:
            if isinstance(obj, AbortReq):
                self.abort_request(obj)
            else:
                self.handle_generate_request(obj)

    def handle_generate_request(self, tokenized: SimpleNamespace) -> None:
        cached = self._cached_prefix(tokenized.input_ids)
        req = _Req(tokenized.rid, tokenized.input_ids, tokenized.sampling_params, tokenized.return_logprob,
                   tokenized.lora_path, cached)
        # managers/utils.py validate_input_length -> Req.set_finish_with_abort (a 400 error abort)
        limit = self.engine.tokenizer_manager.max_req_input_len
        if len(req.origin_input_ids) >= limit:
            req.set_finish_with_abort(
                f"Input length ({len(req.origin_input_ids)} tokens) exceeds the maximum allowed length "
                f"({limit} tokens). Use a shorter input or enable --allow-auto-truncate.")
        elif self.options.inject_error is not None:
            err = self.options.inject_error(req.rid)
            if err is not None:
                status, message = err
                req.to_finish = FINISH_ABORT(message, HTTPStatus(status),
                                             "BadRequestError" if status < 500 else "InternalServerError")
        self._add_request_to_queue(req)

    def _add_request_to_queue(self, req: _Req) -> None:
        # scheduler.py _abort_on_queued_limit (--max-queued-requests)
        if self.max_queued_requests is not None and len(self.waiting_queue) + 1 > self.max_queued_requests:
            self.engine.tokenizer_manager._handle_abort_req(AbortReq(
                rid=req.rid,
                finished_reason={"type": "abort", "status_code": HTTPStatus.SERVICE_UNAVAILABLE,
                                 "message": "The request queue is full."}))
            return
        self.waiting_queue.append(req)

    def abort_request(self, recv_req: AbortReq) -> None:
        """scheduler.py ``Scheduler.abort_request``: PREFIX match (``req.rid.startswith(recv_req.rid)``)."""
        self.aborts_received.append(recv_req)
        to_del = [i for i, req in enumerate(self.waiting_queue)
                  if recv_req.abort_all or req.rid.startswith(recv_req.rid)]
        for i in reversed(to_del):
            # "Abort method 1: directly pop from the queue" and tell the tokenizer manager
            req = self.waiting_queue.pop(i)
            self.engine.tokenizer_manager._handle_abort_req(AbortReq(rid=req.rid))
        for req in self.running:
            if not req.finished() and (recv_req.abort_all or req.rid.startswith(recv_req.rid)):
                # "Abort method 3: set `to_finish`. The request will still run one decode forward pass."
                req.to_finish = FINISH_ABORT()

    # -- the forward pass

    def _admit(self) -> None:
        cap = self.max_running_requests
        while self.waiting_queue and (cap is None or len(self.running) < cap):
            self.running.append(self.waiting_queue.pop(0))

    def _forward(self) -> None:
        self.forward_passes += 1
        tm = self.engine.tokenizer_manager
        token_fn = self.options.token_fn or default_token_fn
        vocab = tm.model_config.vocab_size
        eos_ids = tm.model_config.hf_eos_token_id or set()
        finished: List[_Req] = []
        for req in self.running:
            sp = req.sampling_params
            if sp.get("max_new_tokens", 128) == 0 and req.to_finish is None:
                req.finished_reason = FINISH_LENGTH(length=0)  # prefix-caching request of n > 1
            else:
                position = len(req.output_ids)
                seed = sp.get("sampling_seed")
                token = token_fn(req.prompt_ids, position, seed if seed is not None else req.rid, vocab)
                req.output_ids.append(token)
                req.output_logprobs.append(token_logprob(token, position))
                req.check_finished(tm.tokenizer, eos_ids)
            if req.finished():
                finished.append(req)
        if finished:
            self.running = [r for r in self.running if not r.finished()]
            for req in finished:
                tm._handle_batch_output(req)

    def _cached_prefix(self, ids: List[int]) -> int:
        """Toy radix cache: longest common prefix with an earlier prompt, at most len - 1."""
        best = 0
        for seen in self._seen_prompts:
            n = 0
            for a, b in zip(seen, ids):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        self._seen_prompts.append(tuple(ids))
        return min(best, max(len(ids) - 1, 0))

    def update_weights_from_disk(self, obj: UpdateWeightFromDiskReqInput) -> UpdateWeightFromDiskReqOutput:
        if obj.model_path in self.options.bad_weight_paths:
            return UpdateWeightFromDiskReqOutput(
                success=False, message=f"Failed to get weights iterator: {obj.model_path} (stand-in failure).",
                num_paused_requests=0)
        return UpdateWeightFromDiskReqOutput(success=True, message="Succeeded to update model weights.",
                                             num_paused_requests=0)


# ----------------------------------------------------------------------------- tokenizer manager


@dataclass
class ReqState:
    """tokenizer_manager.py ``ReqState`` (the fields used here)."""

    out_list: List[Dict[Any, Any]]
    finished: bool
    event: asyncio.Event
    obj: GenerateReqInput
    created_time: float
    text: str = ""
    output_ids: List[int] = dataclasses.field(default_factory=list)


class _RWLock:
    """utils/aio_rwlock.py ``RWLock`` stand-in (writer-preferring)."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    async def acquire_read(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and self._writers_waiting == 0)
            self._readers += 1

    async def release_read(self) -> None:
        async with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    async def acquire_write(self) -> None:
        async with self._cond:
            self._writers_waiting += 1
            await self._cond.wait_for(lambda: not self._writer and self._readers == 0)
            self._writers_waiting -= 1
            self._writer = True

    async def release_write(self) -> None:
        async with self._cond:
            self._writer = False
            self._cond.notify_all()


class TokenizerManager:
    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self.server_args = engine.server_args
        options = engine.standin_options
        context = self.server_args.context_length or options.model_context_len
        self.model_config = SimpleNamespace(vocab_size=options.vocab_size, context_len=context,
                                            hf_eos_token_id={StandInTokenizer.eos_token_id}, is_generation=True)
        self.context_len = context
        self.max_req_input_len = options.max_req_input_len or context - 1  # "Will be set later in engine.py"
        self.tokenizer = None if self.server_args.skip_tokenizer_init else StandInTokenizer(options.vocab_size)
        self.rid_to_state: Dict[str, ReqState] = {}
        self.model_update_lock = _RWLock()
        self.scheduler = StandInScheduler(engine)
        self.event_loop: Optional[asyncio.AbstractEventLoop] = None
        self._scheduler_task: Optional[asyncio.Task] = None
        # what the tests inspect
        self.abort_calls: List[tuple] = []
        self.update_calls: List[UpdateWeightFromDiskReqInput] = []
        self.memory_calls: List[tuple] = []

    def auto_create_handle_loop(self) -> None:
        """tokenizer_manager.py: one event loop only ("Please ensure only one event loop is ever used")."""
        loop = asyncio.get_running_loop()
        if self.event_loop is not None:
            assert loop is self.event_loop, (
                f"Please ensure only one event loop is ever used with SGLang. Previous loop: "
                f"{self.event_loop}, current loop: {loop}")
            return
        self.event_loop = loop
        self._scheduler_task = loop.create_task(self.scheduler.run(), name="sglang-standin-scheduler")

    # -- generate

    async def generate_request(self, obj: GenerateReqInput, request: Any = None):
        self.auto_create_handle_loop()
        obj.normalize_batch_and_arguments()
        if obj.is_single:
            self._init_req_state(obj)
        await self.model_update_lock.acquire_read()
        try:
            if obj.is_single:
                try:
                    tokenized = await self._tokenize_one_request(obj)
                except BaseException:
                    self.rid_to_state.pop(obj.rid, None)
                    raise
                self.scheduler.send(tokenized)
                async for response in self._wait_one_response(obj):
                    yield response
            else:
                async for response in self._handle_batch_request(obj):
                    yield response
        finally:
            await self.model_update_lock.release_read()

    def _init_req_state(self, obj: GenerateReqInput) -> None:
        """tokenizer_manager.py ``_init_req_state`` (later 0.5.x): a live rid may not be reused."""
        if obj.rid in self.rid_to_state:
            raise ValueError(f"Duplicate request ID detected: {obj.rid}")
        self.rid_to_state[obj.rid] = ReqState([], False, asyncio.Event(), obj, time.time())

    async def _tokenize_one_request(self, obj: GenerateReqInput) -> SimpleNamespace:
        if self.options.tokenize_delay_s > 0:
            await asyncio.sleep(self.options.tokenize_delay_s)
        if obj.input_ids is not None:
            input_ids = list(obj.input_ids)
        else:
            if self.tokenizer is None:
                raise ValueError(
                    "The engine initialized with skip_tokenizer_init=True cannot accept text prompts. "
                    "Please provide input_ids or re-initialize the engine with skip_tokenizer_init=False.")
            input_ids = self.tokenizer.encode(obj.text)
        self._validate_one_request(obj, input_ids)
        sampling = dict(obj.sampling_params or {})
        _check_sampling_params(sampling)
        return SimpleNamespace(rid=obj.rid, input_ids=input_ids, sampling_params=sampling,
                               return_logprob=bool(obj.return_logprob), lora_path=obj.lora_path)

    def _validate_one_request(self, obj: GenerateReqInput, input_ids: List[int]) -> None:
        """tokenizer_manager.py ``_validate_one_request`` (messages verbatim)."""
        input_token_num = len(input_ids)
        if input_token_num >= self.context_len:
            raise ValueError(f"The input ({input_token_num} tokens) is longer than the model's context "
                             f"length ({self.context_len} tokens).")
        max_new_tokens = (obj.sampling_params or {}).get("max_new_tokens")
        if max_new_tokens is not None and max_new_tokens + input_token_num >= self.context_len:
            total_tokens = max_new_tokens + input_token_num
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {self.context_len} tokens. "
                f"You requested a total of {total_tokens} tokens: {input_token_num} tokens from the input "
                f"messages and {max_new_tokens} tokens for the completion. Please reduce the number of tokens in "
                f"the input messages or the completion to fit within the limit.")

    async def _wait_one_response(self, obj: GenerateReqInput):
        """tokenizer_manager.py ``_wait_one_response`` (non-streaming)."""
        state = self.rid_to_state[obj.rid]
        while True:
            await state.event.wait()
            out = state.out_list[-1]
            state.out_list = []
            finished = state.finished
            state.event.clear()
            if finished:
                finish_reason = out["meta_info"].get("finish_reason")
                if isinstance(finish_reason, dict):
                    if (finish_reason.get("type") == "abort"
                            and finish_reason.get("status_code") == HTTPStatus.BAD_REQUEST):
                        raise ValueError(finish_reason["message"])
                    if finish_reason.get("type") == "abort" and finish_reason.get("status_code") in (
                            HTTPStatus.SERVICE_UNAVAILABLE, HTTPStatus.INTERNAL_SERVER_ERROR):
                        self.rid_to_state.pop(state.obj.rid, None)
                        raise HTTPException(status_code=finish_reason["status_code"],
                                            detail=finish_reason["message"])
                yield out
                break

    async def _handle_batch_request(self, obj: GenerateReqInput):
        """tokenizer_manager.py ``_handle_batch_request`` with parallel sampling (n > 1)."""
        objs = [obj[i] for i in range(obj.batch_size)]
        for o in objs:  # later 0.5.x registers the normalized rids (X_0, ...) too
            self._init_req_state(o)
        tokenized_objs = [await self._tokenize_one_request(o) for o in objs]
        generators = []
        try:
            # "Cache the common prefix for parallel sampling"
            for o, tok in zip(objs, tokenized_objs):
                tmp_obj = copy.copy(o)
                tokenized = copy.copy(tok)
                tokenized.rid = tmp_obj.regenerate_rid()
                tokenized.sampling_params = dict(tokenized.sampling_params, max_new_tokens=0)
                self._init_req_state(tmp_obj)
                self.scheduler.send(tokenized)
                await self._wait_one_response(tmp_obj).__anext__()
            # "Expand requests, assign new rids for them, and send them"
            for o, tok in zip(objs, tokenized_objs):
                for _ in range(obj.parallel_sample_num):
                    tmp_obj = copy.copy(o)
                    tokenized = copy.copy(tok)
                    tokenized.rid = tmp_obj.regenerate_rid()
                    self._init_req_state(tmp_obj)
                    self.scheduler.send(tokenized)
                    generators.append(self._wait_one_response(tmp_obj))
        finally:
            for o in objs:
                self.rid_to_state.pop(o.rid, None)
        outputs = await asyncio.gather(*(gen.__anext__() for gen in generators))
        yield outputs

    # -- outputs from the scheduler

    def _handle_batch_output(self, req: _Req) -> None:
        """tokenizer_manager.py ``_handle_batch_output`` for a finished non-streaming request."""
        state = self.rid_to_state.get(req.rid)
        if state is None:
            log.error("Received output for rid=%r but the state was deleted in TokenizerManager.", req.rid)
            return
        meta_info: Dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finished_reason.to_json(),
            "prompt_tokens": len(req.origin_input_ids),
            "weight_version": self.server_args.weight_version,
            "total_retractions": 0,
        }
        if getattr(state.obj, "return_logprob", False):
            logprobs = req.output_logprobs if req.return_logprob else []
            ids = req.output_ids if req.return_logprob else []
            # detokenize_logprob_tokens(..., decode_to_text=False): (logprob, token_id, None)
            meta_info["input_token_logprobs"] = []
            meta_info["output_token_logprobs"] = [(lp, tid, None) for lp, tid in zip(logprobs, ids)]
        meta_info.update({"completion_tokens": len(req.output_ids), "cached_tokens": req.cached_tokens})
        state.output_ids.extend(req.output_ids)
        if self.tokenizer is not None:  # BatchStrOutput
            state.text += self.tokenizer.decode(req.output_ids)
            out = {"text": state.text, "output_ids": state.output_ids.copy(), "meta_info": meta_info}
        else:  # BatchTokenIDOutput (skip_tokenizer_init)
            out = {"output_ids": state.output_ids.copy(), "meta_info": meta_info}
        state.finished = True
        meta_info["e2e_latency"] = time.time() - state.created_time
        del self.rid_to_state[req.rid]
        state.out_list.append(out)
        state.event.set()

    def _handle_abort_req(self, recv_obj: AbortReq) -> None:
        """tokenizer_manager.py ``_handle_abort_req`` (the waiting-queue abort shape)."""
        state = self.rid_to_state.get(recv_obj.rid)
        if state is None:
            return
        state.finished = True
        abort_message = recv_obj.abort_message or "Abort in waiting queue"
        finish_reason: Dict[str, Any] = {"type": "abort", "message": abort_message}
        if recv_obj.finished_reason:
            finish_reason = recv_obj.finished_reason
        meta_info: Dict[str, Any] = {
            "id": recv_obj.rid,
            "finish_reason": finish_reason,
            "weight_version": self.server_args.weight_version,
            "e2e_latency": time.time() - state.created_time,
        }
        if getattr(state.obj, "return_logprob", False):
            meta_info["input_token_logprobs"] = []
            meta_info["output_token_logprobs"] = []
        meta_info["completion_tokens"] = len(state.output_ids)
        out = {"text": state.text, "output_ids": state.output_ids, "meta_info": meta_info}
        del self.rid_to_state[recv_obj.rid]
        state.out_list.append(out)
        state.event.set()

    # -- control

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """tokenizer_manager.py ``abort_request``: silently ignores a rid it does not hold."""
        self.abort_calls.append((rid, abort_all))
        if not abort_all and not rid:
            log.warning("Ignore abort_request with empty rid and abort_all=False")
            return
        if not abort_all and rid not in self.rid_to_state:
            return
        self.scheduler.send(AbortReq(rid=rid, abort_all=abort_all))

    async def update_weights_from_disk(self, obj: UpdateWeightFromDiskReqInput, request: Any = None):
        """tokenizer_manager.py ``update_weights_from_disk`` -> ``(success, message, num_paused_requests)``."""
        self.auto_create_handle_loop()
        self.update_calls.append(obj)
        if obj.load_format is None:
            obj.load_format = self.server_args.load_format
        if obj.abort_all_requests:
            self.abort_request(abort_all=True)
        await self.model_update_lock.acquire_write()  # waits for the requests in flight
        try:
            result = self.scheduler.update_weights_from_disk(obj)
        finally:
            await self.model_update_lock.release_write()
        success, message = result.success, result.message
        if success:
            self.server_args.model_path = obj.model_path
            self.server_args.load_format = obj.load_format
        if success and obj.weight_version is not None:
            self.server_args.weight_version = obj.weight_version
            message += f" Weight version updated to {obj.weight_version}."
        return success, message, result.num_paused_requests

    async def release_memory_occupation(self, obj: ReleaseMemoryOccupationReqInput, request: Any = None):
        self.auto_create_handle_loop()
        self.memory_calls.append(("release", obj.tags))
        return None

    async def resume_memory_occupation(self, obj: ResumeMemoryOccupationReqInput, request: Any = None):
        self.auto_create_handle_loop()
        self.memory_calls.append(("resume", obj.tags))
        return None

    async def get_internal_state(self) -> List[Dict[str, Any]]:
        return [{"waiting": len(self.scheduler.waiting_queue), "running": len(self.scheduler.running)}]

    @property
    def options(self) -> StandInOptions:
        return self.engine.standin_options


# ----------------------------------------------------------------------------- the engine

_SERVER_ARG_DEFAULTS: Dict[str, Any] = {
    "tp_size": 1, "dp_size": 1, "mem_fraction_static": None, "max_running_requests": None,
    "max_queued_requests": None, "context_length": None, "dtype": "auto", "random_seed": None,
    "enable_memory_saver": False, "skip_tokenizer_init": False, "weight_version": "default",
    "load_format": "auto", "enable_lora": None, "lora_paths": None, "log_level": "error",
}


class Engine:
    """``sglang.Engine`` stand-in: same constructor contract (``**kwargs`` -> ServerArgs) and async API."""

    standin_options = StandInOptions()
    instances: List["Engine"] = []

    @classmethod
    def with_options(cls, **options: Any) -> type:
        """A subclass (still an engine factory, still in this module) with other stand-in knobs."""
        return type("Engine", (cls,), {"standin_options": StandInOptions(**options), "__module__": __name__})

    def __init__(self, **kwargs: Any) -> None:
        if "model_path" not in kwargs:
            raise TypeError("ServerArgs.__init__() missing 1 required positional argument: 'model_path'")
        self.kwargs = dict(kwargs)
        if "log_level" not in kwargs:
            kwargs["log_level"] = "error"  # engine.py: "Do not print logs by default"
        args = dict(_SERVER_ARG_DEFAULTS)
        args.update(kwargs)
        if args.get("lora_paths") and args.get("enable_lora") is None:
            args["enable_lora"] = True
        self.server_args = SimpleNamespace(**args)
        self.tokenizer_manager = TokenizerManager(self)
        self.shutdown_called = False
        self.calls: List[Dict[str, Any]] = []
        try:
            self.loop = asyncio.get_running_loop()
        except RuntimeError:  # pragma: no cover
            self.loop = asyncio.new_event_loop()
        type(self).instances.append(self)

    async def async_generate(
        self,
        prompt: Optional[Union[List[str], str]] = None,
        sampling_params: Optional[Union[List[Dict], Dict]] = None,
        input_ids: Optional[Union[List[List[int]], List[int]]] = None,
        image_data: Any = None,
        audio_data: Any = None,
        video_data: Any = None,
        return_logprob: Optional[Union[List[bool], bool]] = False,
        logprob_start_len: Optional[Union[List[int], int]] = None,
        top_logprobs_num: Optional[Union[List[int], int]] = None,
        token_ids_logprob: Optional[Union[List[List[int]], List[int]]] = None,
        lora_path: Optional[List[Optional[str]]] = None,
        custom_logit_processor: Optional[Union[List[str], str]] = None,
        return_hidden_states: bool = False,
        stream: bool = False,
        bootstrap_host: Any = None,
        bootstrap_port: Any = None,
        bootstrap_room: Any = None,
        data_parallel_rank: Optional[int] = None,
        external_trace_header: Optional[Dict] = None,
        rid: Optional[Union[List[str], str]] = None,
    ) -> Union[Dict, List[Dict]]:
        if stream:
            raise NotImplementedError("stand-in: streaming is not modelled")
        if image_data is not None or audio_data is not None or video_data is not None:
            raise NotImplementedError("stand-in: multimodal inputs are not modelled")
        self.calls.append({"prompt": prompt, "input_ids": copy.copy(input_ids),
                           "sampling_params": copy.deepcopy(sampling_params), "return_logprob": return_logprob,
                           "lora_path": lora_path, "rid": rid})
        obj = GenerateReqInput(
            text=prompt, input_ids=input_ids, sampling_params=sampling_params, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            token_ids_logprob=token_ids_logprob, lora_path=lora_path,
            custom_logit_processor=custom_logit_processor, stream=stream, data_parallel_rank=data_parallel_rank,
            rid=rid)
        generator = self.tokenizer_manager.generate_request(obj, None)
        return await generator.__anext__()

    # The sync wrappers of engine.py: ``self.loop.run_until_complete(...)``; inside a running loop
    # they raise "RuntimeError: This event loop is already running", as the real ones do.

    def _run_sync(self, coro: Any) -> Any:
        try:
            return self.loop.run_until_complete(coro)
        except RuntimeError:
            coro.close()
            raise

    def update_weights_from_disk(self, model_path: str, load_format: Optional[str] = None):
        obj = UpdateWeightFromDiskReqInput(model_path=model_path, load_format=load_format)
        return self._run_sync(self.tokenizer_manager.update_weights_from_disk(obj, None))

    def release_memory_occupation(self, tags: Optional[List[str]] = None):
        obj = ReleaseMemoryOccupationReqInput(tags=tags)
        return self._run_sync(self.tokenizer_manager.release_memory_occupation(obj, None))

    def resume_memory_occupation(self, tags: Optional[List[str]] = None):
        obj = ResumeMemoryOccupationReqInput(tags=tags)
        return self._run_sync(self.tokenizer_manager.resume_memory_occupation(obj, None))

    def get_server_info(self) -> Dict[str, Any]:
        internal_states = self._run_sync(self.tokenizer_manager.get_internal_state())
        return {**vars(self.server_args), "internal_states": internal_states, "version": "0.5.x-standin"}

    def shutdown(self) -> None:
        self.shutdown_called = True
        task = self.tokenizer_manager._scheduler_task
        if task is not None:
            task.cancel()


__all__ = [
    "AbortReq", "Engine", "FINISH_ABORT", "FINISH_LENGTH", "FINISH_MATCHED_STR", "FINISH_MATCHED_TOKEN",
    "GenerateReqInput", "HTTPException", "ReleaseMemoryOccupationReqInput", "ResumeMemoryOccupationReqInput",
    "StandInOptions", "StandInTokenizer", "TokenizerManager", "UpdateWeightFromDiskReqInput",
    "UpdateWeightFromDiskReqOutput", "default_token_fn", "token_logprob",
]
