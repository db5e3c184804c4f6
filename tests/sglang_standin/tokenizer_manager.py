"""``sglang/srt/managers/tokenizer_manager.py`` (0.5.23): the part of SGLang that runs in the
worker's own process and event loop, which is where the adapter's bugs would hide."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import sys
import threading
import time
from http import HTTPStatus
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from .io_struct import (
    AbortReq,
    BeginWeightUpdateReqInput,
    ContinueGenerationReqInput,
    DestroyWeightsUpdateGroupReqInput,
    EndWeightUpdateReqInput,
    FlushCacheReqOutput,
    GenerateReqInput,
    InitWeightsUpdateGroupReqInput,
    PauseGenerationReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightVersionReqInput,
)
from .scheduler import StandInScheduler, token_logprob  # noqa: F401  (token_logprob re-exported)

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine

log = logging.getLogger("tests.sglang_standin")

try:  # _handle_abort_finish_reason raises fastapi.HTTPException (:1919)
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


SAMPLING_PARAM_NAMES = frozenset({
    # sampling/sampling_params.py:149-181 (an unknown key is a TypeError from SamplingParams(**kw), :1565)
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "beam_width",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
    "custom_params", "watermark",
})


class StandInTokenizer:
    """Byte-level toy tokenizer: ids 0/1/2 are pad/bos/eos, byte b is id b + 3."""

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids: List[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", errors="replace")


@dataclasses.dataclass
class ReqState:
    """:267-285."""

    out_list: List[Dict[Any, Any]]
    finished: bool
    event: asyncio.Event
    obj: GenerateReqInput
    time_stats: float
    """(the real one is an APIServerReqTimeStats; here: when the request was received)"""
    text: str = ""
    output_ids: List[int] = dataclasses.field(default_factory=list)
    dispatched: bool = False
    abort_sent: bool = False
    logprobs: List[Any] = dataclasses.field(default_factory=list)
    """The live list streaming chunks hand out (:2868-2869)."""


class _RWLock:
    """utils/aio_rwlock.py:4-104 (writer-preferring)."""

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


class SignalHandler:
    """:4062-4081."""

    def __init__(self, tokenizer_manager: "TokenizerManager") -> None:
        self.tokenizer_manager = tokenizer_manager

    def sigterm_handler(self, signum: Any = None, frame: Any = None) -> None:
        self.tokenizer_manager.gracefully_exit = True

    def running_phase_sigquit_handler(self, signum: Any = None, frame: Any = None) -> None:
        self.tokenizer_manager.engine.kill_process_tree(include_parent=True)


class _SubprocessWatchdog:
    """utils/watchdog.py:166-223 (``stop()`` is what the adapter calls)."""

    def __init__(self) -> None:
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True


class TokenizerManager:
    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self.server_args = engine.server_args
        options = engine.standin_options
        context = self.server_args.context_length or options.model_context_len
        layers, top_k = options.routed_experts or (None, None)
        self.model_config = SimpleNamespace(vocab_size=options.vocab_size, context_len=context,
                                            hf_eos_token_id={StandInTokenizer.eos_token_id}, is_generation=True,
                                            hf_config=SimpleNamespace(num_hidden_layers=layers,
                                                                      num_experts_per_tok=top_k))
        self.context_len = context  # :600
        self.max_req_input_len = options.max_req_input_len or context - 6  # tp_worker.py:568-572 via engine.py:1355
        self.num_reserved_tokens = options.num_reserved_tokens  # :605
        self.enable_lora = self.server_args.resolved_enable_lora()  # :544 (not server_args.enable_lora)
        self.incremental_streaming_output = bool(self.server_args.incremental_streaming_output)  # :543
        self.weight_version = str(self.server_args.weight_version)
        self.tokenizer = None if self.server_args.skip_tokenizer_init else StandInTokenizer(options.vocab_size)
        self.rid_to_state: Dict[str, ReqState] = {}  # :710
        self.asyncio_tasks: set = set()  # :713
        self.model_update_lock = _RWLock()  # :771
        self.is_pause = False
        self.is_pause_cond = asyncio.Condition()
        self.scheduler = StandInScheduler(engine)
        self.event_loop: Optional[asyncio.AbstractEventLoop] = None
        self.signal_handler_class = SignalHandler  # :893
        self.gracefully_exit = False
        self._subprocess_watchdog = _SubprocessWatchdog()
        # what the tests inspect
        self.abort_calls: List[tuple] = []
        self.aborts_dispatched: List[str] = []
        self.update_calls: List[Any] = []
        self.memory_calls: List[tuple] = []

    @property
    def options(self) -> Any:
        return self.engine.standin_options

    def config_value(self, name: str) -> Any:
        """:2333-2337 (the value in effect; server_args keeps the launch value)."""
        return self.weight_version if name == "weight_version" else getattr(self.server_args, name)

    def auto_create_handle_loop(self) -> None:
        """:2440-2463: binds to the running loop on the first call, starts the loop task and the
        SIGTERM watchdog, and (in the main thread) replaces the process's SIGTERM/SIGQUIT handlers."""
        if self.event_loop is not None:
            return
        loop = asyncio.get_running_loop()
        self.asyncio_tasks.add(loop.create_task(self.scheduler.run(), name="sglang-standin-scheduler"))
        self.event_loop = loop
        if threading.current_thread() is threading.main_thread():
            handler = self.signal_handler_class(self)
            loop.add_signal_handler(signal.SIGTERM, handler.sigterm_handler)
            loop.add_signal_handler(signal.SIGQUIT, handler.running_phase_sigquit_handler)
        self.asyncio_tasks.add(loop.create_task(self.sigterm_watchdog(), name="sglang-standin-watchdog"))

    async def sigterm_watchdog(self) -> None:
        """:3508-3571: after SIGTERM wait until no request is held, kill every child process, exit."""
        while not self.gracefully_exit:
            await asyncio.sleep(self.options.watchdog_interval_s)
        while self.rid_to_state:
            await asyncio.sleep(self.options.watchdog_interval_s)
        self._subprocess_watchdog.stop()
        self.engine.kill_process_tree(include_parent=False)
        sys.exit(0)  # :3571 (SystemExit out of the worker's event loop)

    # ------------------------------------------------------------------ generate

    async def generate_request(self, obj: GenerateReqInput, request: Any = None):
        """:895-967."""
        self.auto_create_handle_loop()
        obj.normalize_batch_and_arguments()
        if not obj.is_single:
            async for response in self._handle_batch_request(obj):
                yield response
            return
        self._init_req_state(obj)
        states = {obj.rid: self.rid_to_state[obj.rid]}
        try:
            async with self.is_pause_cond:
                await self.is_pause_cond.wait_for(lambda: not self.is_pause)
            await self.model_update_lock.acquire_read()
            try:
                self._validate_lora(obj)
                tokenized = await self._tokenize_one_request(obj)
                self.scheduler.send(tokenized)  # _dispatch_to_scheduler (:1789)
                self.rid_to_state[obj.rid].dispatched = True  # _mark_state_dispatched (:1802-1810)
                async for response in self._wait_one_response(obj):
                    yield response
            finally:
                await self.model_update_lock.release_read()
        except BaseException:
            self._release_req_states_on_failure(states)
            raise

    def _init_req_state(self, obj: GenerateReqInput) -> None:
        """:3835-3842: a rid still held (an abort in flight included) may not be reused."""
        if obj.rid in self.rid_to_state:
            raise ValueError(f"Duplicate request ID detected: {obj.rid}")
        self.rid_to_state[obj.rid] = ReqState([], False, asyncio.Event(), obj, time.time())

    def _release_req_states_on_failure(self, states: Dict[str, ReqState]) -> None:
        """:3850-3874: undelivered states are dropped locally (no AbortReq); dispatched ones are
        aborted and kept until the scheduler answers."""
        for rid, state in states.items():
            current = self.rid_to_state.get(rid)
            if current is None or current is not state:
                continue
            if state.dispatched:
                self.abort_request(rid)
            else:
                del self.rid_to_state[rid]

    def _validate_lora(self, obj: GenerateReqInput) -> None:
        """:3729-3736."""
        if obj.lora_path is not None and not self.enable_lora:
            raise ValueError(f"LoRA adapter '{obj.lora_path}' was requested, but LoRA is not enabled. Please launch "
                             "the server with --enable-lora.")

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
        unknown = sorted(set(sampling) - SAMPLING_PARAM_NAMES)
        if unknown:
            raise TypeError(f"Unexpected keyword argument '{unknown[0]}'")
        return SimpleNamespace(rid=obj.rid, input_ids=input_ids, sampling_params=sampling,
                               return_logprob=bool(obj.return_logprob), lora_path=obj.lora_path, stream=obj.stream)

    def _validate_one_request(self, obj: GenerateReqInput, input_ids: List[int]) -> None:
        """:1307-1435 (messages verbatim): ``>=`` for the input, ``>`` for input + max_new_tokens,
        reserved (speculative) tokens counted (:1334-1335)."""
        input_token_num = len(input_ids) + self.num_reserved_tokens
        if input_token_num >= self.context_len:
            raise ValueError(f"The input ({input_token_num} tokens) is longer than the model's context "
                             f"length ({self.context_len} tokens).")
        max_new_tokens = (obj.sampling_params or {}).get("max_new_tokens")
        if max_new_tokens is not None and (max_new_tokens + input_token_num) > self.context_len:
            total_tokens = max_new_tokens + input_token_num
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {self.context_len} tokens. "
                f"You requested a total of {total_tokens} tokens: {input_token_num} tokens from the input "
                f"messages and {max_new_tokens} tokens for the completion. Please reduce the number of tokens in "
                f"the input messages or the completion to fit within the limit.")

    async def _wait_one_response(self, obj: GenerateReqInput):
        """:1936-2072; a finished chunk goes through ``_handle_abort_finish_reason`` (:1891-1922)."""
        state = self.rid_to_state[obj.rid]
        while True:
            await state.event.wait()
            out = state.out_list[-1]  # several queued chunks: only the newest (cumulative) one (:1993)
            state.out_list = []
            finished = state.finished
            state.event.clear()
            if finished:
                self._handle_abort_finish_reason(state, out, obj.stream)
                yield out
                return
            if obj.stream:
                yield out

    def _handle_abort_finish_reason(self, state: ReqState, out: dict, is_stream: bool) -> None:
        """:1891-1922: an abort with a status in [400, 600) raises (400 ValueError, others
        HTTPException) when not streaming; without a status it is an ordinary output."""
        finish = out["meta_info"].get("finish_reason")
        if not isinstance(finish, dict) or finish.get("type") != "abort":
            return
        status = finish.get("status_code")
        if status is None or not HTTPStatus.BAD_REQUEST <= status < 600:
            return
        if self.rid_to_state.get(state.obj.rid) is state:
            del self.rid_to_state[state.obj.rid]
        if not is_stream:
            if status == HTTPStatus.BAD_REQUEST:
                raise ValueError(finish["message"])
            raise HTTPException(status_code=status, detail=finish["message"])

    async def _handle_batch_request(self, obj: GenerateReqInput):
        """:2120-2192 with parallel sampling (n > 1): a prefix-caching request, then n copies, each
        with a fresh ``regenerate_rid()`` (:2144, :2174); the caller's rids are dropped (:2156-2161)."""
        objs = [obj[i] for i in range(obj.batch_size)]
        tokenized_objs = [await self._tokenize_one_request(o) for o in objs]
        generators = []
        for o, tok in zip(objs, tokenized_objs):
            tmp = dataclasses.replace(o)
            tokenized = SimpleNamespace(**{**vars(tok), "rid": tmp.regenerate_rid(),
                                           "sampling_params": dict(tok.sampling_params, max_new_tokens=0)})
            self._init_req_state(tmp)
            self.scheduler.send(tokenized)
            self.rid_to_state[tmp.rid].dispatched = True
            await self._wait_one_response(tmp).__anext__()
        for o, tok in zip(objs, tokenized_objs):
            for _ in range(obj.parallel_sample_num):
                tmp = dataclasses.replace(o)
                tokenized = SimpleNamespace(**{**vars(tok), "rid": tmp.regenerate_rid()})
                self._init_req_state(tmp)
                self.scheduler.send(tokenized)
                self.rid_to_state[tmp.rid].dispatched = True
                generators.append(self._wait_one_response(tmp))
        yield list(await asyncio.gather(*(gen.__anext__() for gen in generators)))

    # ------------------------------------------------------------------ outputs from the scheduler

    def _meta(self, state: ReqState, req: Any) -> Dict[str, Any]:
        meta: Dict[str, Any] = {"id": req.rid, "finish_reason": None, "prompt_tokens": len(req.origin_input_ids),
                                "weight_version": self.config_value("weight_version"),
                                "num_retractions": req.retraction_count}  # :2507-2513
        if getattr(state.obj, "return_logprob", False):
            logprobs = req.output_logprobs if req.return_logprob else []
            ids = req.output_ids if req.return_logprob else []
            # (logprob, token_id, None) unless return_text_in_logprobs (:3104-3105)
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [(lp, tid, None) for lp, tid in zip(logprobs, ids)]
            start = getattr(state.obj, "logprob_start_len", -1)
            if start is not None and start >= 0:  # (the first prompt token has no logprob: None)
                prompt = req.origin_input_ids
                meta["input_token_logprobs"] = [(None if i == 0 else token_logprob(prompt[i], i - 1), prompt[i], None)
                                                for i in range(start, len(prompt))]
            k = getattr(state.obj, "top_logprobs_num", 0) or 0
            if k > 0:  # :2973 / :3118-3136: per position, k (logprob, token_id, None), most likely first
                meta["output_top_logprobs"] = [
                    sorted([(lp, tid, None)] + [(lp - 1.0 - j, (tid + j + 1) % self.model_config.vocab_size, None)
                                                for j in range(k - 1)], reverse=True)
                    for lp, tid in zip(logprobs, ids)]
        meta.update({"completion_tokens": len(req.output_ids), "cached_tokens": req.cached_tokens})  # :2553-2559
        return meta

    def _handle_stream_output(self, req: Any) -> None:
        """An intermediate chunk of a streaming request (:2626-2664): cumulative ``output_ids`` by
        default, handed out as the live list (no copy, :2656-2662); deltas with
        ``incremental_streaming_output``. Sent every ``stream_interval`` tokens, the first at once
        (output_streamer.py:455-469)."""
        state = self.rid_to_state.get(req.rid)
        if state is None:
            return
        interval = req.sampling_params.get("stream_interval") or self.server_args.stream_interval
        unsent = len(req.output_ids) - req.sent_offset
        if not (interval == 1 or unsent >= interval or (req.sent_offset == 0 and unsent > 0)):
            return
        delta = req.output_ids[req.sent_offset:]
        state.output_ids.extend(delta)
        meta = self._meta(state, req)
        if self.incremental_streaming_output:
            if "output_token_logprobs" in meta:
                meta["output_token_logprobs"] = meta["output_token_logprobs"][req.sent_offset:]
            out = {"output_ids": list(delta), "meta_info": meta}
        else:
            if "output_token_logprobs" in meta:
                state.logprobs[:] = meta["output_token_logprobs"]
                meta["output_token_logprobs"] = state.logprobs  # the live list (:2868-2869)
            out = {"output_ids": state.output_ids, "meta_info": meta}
        req.sent_offset = len(req.output_ids)
        state.out_list.append(out)
        state.event.set()

    def _handle_batch_output(self, req: Any, spans: List[dict]) -> None:
        """A finished request (:2480-2797)."""
        state = self.rid_to_state.get(req.rid)
        if state is None:
            log.error("Received output for rid=%r but the state was deleted in TokenizerManager.", req.rid)
            return
        meta = self._meta(state, req)
        meta["finish_reason"] = req.finished_reason.to_json()
        if getattr(state.obj, "return_routed_experts", False) and self.server_args.enable_return_routed_experts:
            # :2602-2609, base64 of int32 [seqlen - 1, layers, top_k] (detokenizer_manager.py:432-448)
            import array
            import base64

            layers, top_k = self.options.routed_experts
            tokens = len(req.origin_input_ids) + len(req.output_ids) - 1
            values = array.array("i", [(t * 7 + layer * 3 + j) % 64 for t in range(tokens) for layer in range(layers)
                                       for j in range(top_k)])
            meta["routed_experts"] = base64.b64encode(values.tobytes()).decode()
        # utils/weight_versions.py:90-107: the spans, and weight_version overwritten by the last one
        meta["weight_versions"] = spans
        meta["weight_version"] = spans[-1]["version"]
        delta = req.output_ids[req.sent_offset:] if state.obj.stream else req.output_ids
        state.output_ids.extend(delta)
        if self.tokenizer is not None:
            state.text = self.tokenizer.decode(state.output_ids)
        if state.obj.stream and self.incremental_streaming_output:
            out_ids = list(delta)
            if "output_token_logprobs" in meta:
                meta["output_token_logprobs"] = meta["output_token_logprobs"][req.sent_offset:]
        else:
            out_ids = state.output_ids.copy()  # the finished chunk is a copy (:2653)
        out = {"output_ids": out_ids, "meta_info": meta}
        if self.tokenizer is not None:
            out["text"] = state.text
        state.finished = True
        meta["e2e_latency"] = time.time() - state.time_stats  # :2753
        del self.rid_to_state[req.rid]
        state.out_list.append(out)
        state.event.set()

    def _handle_abort_req(self, recv_obj: AbortReq) -> None:
        """:3577-3643 (an abort in the waiting queue): no prompt_tokens, cached_tokens or num_retractions."""
        state = self.rid_to_state.get(recv_obj.rid)
        if state is None:
            return
        state.finished = True
        finish_reason: Dict[str, Any] = {"type": "abort", "message": recv_obj.abort_message or "Abort in waiting queue"}
        if recv_obj.finished_reason:
            finish_reason = recv_obj.finished_reason
        meta: Dict[str, Any] = {"id": recv_obj.rid, "finish_reason": finish_reason,
                                "weight_version": self.config_value("weight_version"),
                                "e2e_latency": time.time() - state.time_stats}
        if getattr(state.obj, "return_logprob", False):
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = []
        meta["completion_tokens"] = len(state.output_ids)
        out = {"text": state.text, "output_ids": state.output_ids, "meta_info": meta}
        del self.rid_to_state[recv_obj.rid]
        state.out_list.append(out)
        state.event.set()

    # ------------------------------------------------------------------ control

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """:2241-2265: one AbortReq per rid (``abort_sent``); an unknown rid sends nothing."""
        self.abort_calls.append((rid, abort_all))
        if not abort_all and not rid:
            log.warning("Ignore abort_request with empty rid and abort_all=False")
            return
        state = None if abort_all else self.rid_to_state.get(rid)
        if not abort_all:
            if state is None:
                return
            if state.abort_sent:
                return
            state.abort_sent = True
        self.aborts_dispatched.append(rid)
        self.scheduler.send(AbortReq(rid=rid, abort_all=abort_all))

    async def update_weights_from_disk(self, obj: UpdateWeightFromDiskReqInput, request: Any = None):
        """:2288-2322 -> ``(success, message, num_paused_requests)``; waits for every request in
        flight (the writer lock, :2306-2309) unless generation is paused."""
        self.auto_create_handle_loop()
        self.update_calls.append(obj)
        if obj.load_format is None:
            obj.load_format = self.server_args.load_format
        if obj.abort_all_requests:
            self.abort_request(abort_all=True)
        if self.is_pause:
            result = await self.scheduler.control(lambda: self.scheduler.update_weights_from_disk(obj))
        else:
            await self.model_update_lock.acquire_write()
            try:
                result = await self.scheduler.control(lambda: self.scheduler.update_weights_from_disk(obj))
            finally:
                await self.model_update_lock.release_write()
        success, message = result.success, result.message
        if success and obj.weight_version is not None:
            self.weight_version = obj.weight_version
            message += f" Weight version updated to {obj.weight_version}."
        return success, message, result.num_paused_requests

    # a trainer's push: managers/tokenizer_control_mixin.py:445-596 (every call asserts dp_size 1)

    def _assert_single_dp(self, what: str) -> None:
        assert self.server_args.dp_size == 1, f"data-parallel replicas are not supported for {what}"

    async def _under_update_lock(self, fn: Any) -> Any:
        """:471-483 and :517-524: the scheduler call, under the writer lock unless paused (the
        pause condition held meanwhile, so an unpause cannot race it)."""
        async with self.is_pause_cond:
            is_paused = self.is_pause
            if is_paused:
                result = await self.scheduler.control(fn)
        if not is_paused:
            await self.model_update_lock.acquire_write()
            try:
                result = await self.scheduler.control(fn)
            finally:
                await self.model_update_lock.release_write()
        return result

    async def init_weights_update_group(self, obj: InitWeightsUpdateGroupReqInput, request: Any = None):
        """:445-456 -> (success, message)."""
        self.auto_create_handle_loop()
        self._assert_single_dp("update weights from distributed")
        self.update_calls.append(obj)
        result = await self.scheduler.control(lambda: self.scheduler.init_weights_update_group(obj))
        return result.success, result.message

    async def destroy_weights_update_group(self, obj: DestroyWeightsUpdateGroupReqInput, request: Any = None):
        """:458-469."""
        self.auto_create_handle_loop()
        self._assert_single_dp("destroy parameter update group")
        self.update_calls.append(obj)
        result = await self.scheduler.control(lambda: self.scheduler.destroy_weights_update_group(obj))
        return result.success, result.message

    async def begin_weight_update(self, obj: BeginWeightUpdateReqInput, request: Any = None):
        """:485-492."""
        self.auto_create_handle_loop()
        self.update_calls.append(obj)
        result = await self._under_update_lock(lambda: self.scheduler.begin_weight_update(obj))
        return result.success, result.message

    async def end_weight_update(self, obj: EndWeightUpdateReqInput, request: Any = None):
        """:494-501."""
        self.auto_create_handle_loop()
        self.update_calls.append(obj)
        result = await self._under_update_lock(lambda: self.scheduler.end_weight_update(obj))
        return result.success, result.message

    async def update_weights_from_distributed(self, obj: UpdateWeightsFromDistributedReqInput, request: Any = None):
        """:503-533: the version is recorded only on success (:529-531)."""
        self.auto_create_handle_loop()
        self._assert_single_dp("update weights from distributed")
        self.update_calls.append(obj)
        if obj.abort_all_requests:
            self.abort_request(abort_all=True)
        result = await self._under_update_lock(lambda: self.scheduler.update_weights_from_distributed(obj))
        success, message = result.success, result.message
        if success and obj.weight_version is not None:
            self.weight_version = obj.weight_version
            message += f" Weight version updated to {obj.weight_version}."
        return success, message

    async def update_weights_from_tensor(self, obj: UpdateWeightsFromTensorReqInput, request: Any = None):
        """:563-596."""
        self.auto_create_handle_loop()
        self._assert_single_dp("update weights from tensor")
        self.update_calls.append(obj)
        if obj.abort_all_requests:
            self.abort_request(abort_all=True)
        result = await self._under_update_lock(lambda: self.scheduler.update_weights_from_tensor(obj))
        success, message = result.success, result.message
        if success and obj.weight_version is not None:
            self.weight_version = obj.weight_version
            message += f" Weight version updated to {obj.weight_version}."
        return success, message

    async def update_weight_version(self, obj: UpdateWeightVersionReqInput) -> None:
        """mixin :1065-1070 (``abort_all_requests`` ignored)."""
        self.auto_create_handle_loop()
        self.update_calls.append(obj)
        self.scheduler.weight_version = obj.new_version
        self.weight_version = obj.new_version

    async def flush_cache(self, timeout_s: Optional[float] = None) -> FlushCacheReqOutput:
        """tokenizer_control_mixin.py:325-334."""
        self.auto_create_handle_loop()
        return FlushCacheReqOutput(success=await self.scheduler.control(self.scheduler.flush_cache))

    async def pause_generation(self, obj: PauseGenerationReqInput) -> None:
        """:2267-2280: abort mode aborts everything until no request holds the reader lock."""
        async with self.is_pause_cond:
            self.is_pause = True
            if obj.mode != "abort":
                await self.scheduler.control(lambda: self.scheduler.pause_generation(obj))
            else:
                while True:
                    self.abort_request(abort_all=True)
                    if self.model_update_lock._readers == 0 and not self.model_update_lock._writer:
                        break
                    await asyncio.sleep(1.0)

    async def continue_generation(self, obj: ContinueGenerationReqInput) -> None:
        """:2282-2286."""
        async with self.is_pause_cond:
            self.is_pause = False
            await self.scheduler.control(lambda: self.scheduler.continue_generation(obj))
            self.is_pause_cond.notify_all()

    async def release_memory_occupation(self, obj: ReleaseMemoryOccupationReqInput, request: Any = None):
        """tokenizer_control_mixin.py:874-880 -> None."""
        self.auto_create_handle_loop()
        self.memory_calls.append(("release", obj.tags))
        self.scheduler.release_memory_occupation(obj)

    async def resume_memory_occupation(self, obj: ResumeMemoryOccupationReqInput, request: Any = None):
        """tokenizer_control_mixin.py:882-888 -> None."""
        self.auto_create_handle_loop()
        self.memory_calls.append(("resume", obj.tags))
        self.scheduler.resume_memory_occupation(obj)

    async def get_internal_state(self) -> List[Dict[str, Any]]:
        return [{"waiting": len(self.scheduler.waiting_queue), "running": len(self.scheduler.running)}]
