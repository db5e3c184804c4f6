"""``sglang/srt/entrypoints/engine.py`` (0.5.23): the offline ``sglang.Engine``."""

from __future__ import annotations

import asyncio
import atexit
import copy
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Union

from . import io_struct as io_struct_module
from . import utils as utils_module
from .io_struct import (
    GenerateReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    UpdateWeightFromDiskReqInput,
)
from .server_args import ServerArgs
from .tokenizer_manager import TokenizerManager


@dataclass
class StandInOptions:
    """Knobs of the stand-in (not SGLang arguments)."""

    token_delay_s: float = 0.002
    """Time of one forward pass (one token for every running request)."""
    tokenize_delay_s: float = 0.0
    """Time between registering a request's state and dispatching it to the scheduler
    (tokenization): an abort sent in this window reaches a scheduler that does not hold the
    request yet, and SGLang drops every later abort for that rid."""
    vocab_size: int = 1000
    model_context_len: int = 4096
    max_req_input_len: Optional[int] = None
    """The scheduler's input limit (default context_len - 6: tp_worker.py:568-572)."""
    num_reserved_tokens: int = 0
    """Speculative-decoding tokens the tokenizer counts on top of the input (tokenizer_manager.py:605)."""
    token_fn: Optional[Callable[[List[int], int, Any, int], int]] = None
    """(prompt ids, position, seed, vocab) -> token. Default: a hash that never yields 0, 1 or 2."""
    inject_error: Optional[Callable[[str], Optional[tuple]]] = None
    """rid -> (status_code, message) to make the scheduler abort that request with an error."""
    bad_weight_paths: frozenset = frozenset()
    """update_weights_from_disk fails for these model paths."""
    load_s: float = 0.0
    """How long the constructor blocks its thread (loading the model)."""
    watchdog_interval_s: float = 5.0
    """The SIGTERM watchdog's poll interval (tokenizer_manager.py:3509-3510: 5 s)."""
    child_pids: tuple = ()
    """What ``get_all_child_pids`` returns (the scheduler and detokenizer processes)."""
    shutdown_s: float = 0.3
    """How long ``shutdown()`` blocks its thread (it waits for the killed processes, up to 60 s)."""
    param_shapes: Optional[Dict[str, tuple]] = None
    """The model's parameter shapes (name -> shape) a weight update must fit; None: any."""
    group_timeout_s: float = 60.0
    """The weight-update group's timeout (SGLang's is c10d's default, 30 minutes: utils/common.py:2891-2892)."""
    routed_experts: Optional[tuple] = None
    """(num_layers, top_k) of an MoE model started with --enable-return-routed-experts."""
    kill_for_real: bool = False
    """``kill_process_tree`` SIGKILLs every descendant of this process, as SGLang does
    (utils/common.py:2507-2564). Off by default in the test process, where it would kill the
    suite's redis-server: then it only records, in ``Engine.killed``, whom it would have killed."""


def _descendants(pid: int) -> List[int]:
    """Every descendant of ``pid`` (from /proc, as psutil's ``children(recursive=True)``)."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class Engine:
    """``sglang.Engine``: ``**kwargs`` → ServerArgs (engine.py:297), the async API, the sync wrappers."""

    standin_options = StandInOptions()
    instances: List["Engine"] = []
    io_struct = io_struct_module
    """(the adapter's seam: where it takes io_struct classes and utils from, instead of sglang.srt)"""
    utils = utils_module

    @classmethod
    def with_options(cls, **options: Any) -> type:
        """A subclass (still an engine factory, still in this module) with other stand-in knobs."""
        return type("Engine", (cls,), {"standin_options": StandInOptions(**options), "__module__": __name__})

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = dict(kwargs)
        if "log_level" not in kwargs:
            kwargs["log_level"] = "error"  # engine.py:294-296 "Do not print logs by default"
        self.server_args = ServerArgs(**kwargs)
        if self.standin_options.load_s:
            time.sleep(self.standin_options.load_s)  # blocks its thread until the model is loaded (:1350)
        self.tokenizer_manager = TokenizerManager(self)
        self.server_args.seal()
        self.killed: List[int] = []
        self.shutdown_calls = 0
        self.calls: List[Dict[str, Any]] = []
        """What async_generate was called with (for the tests)."""
        try:  # _ensure_event_loop (:1404-1414): the running loop, else a new one for this thread
            self.loop = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = asyncio.new_event_loop()
        atexit.register(self.shutdown)  # :326
        type(self).instances.append(self)

    async def async_generate(
        self,
        prompt: Optional[Union[List[str], str]] = None,
        sampling_params: Optional[Union[List[Dict], Dict]] = None,
        input_ids: Optional[Union[List[List[int]], List[int]]] = None,
        image_data: Any = None,
        audio_data: Any = None,
        video_data: Any = None,
        mm_hashes: Any = None,
        mm_content_hashes: Any = None,
        return_logprob: Optional[Union[List[bool], bool]] = False,
        logprob_start_len: Optional[Union[List[int], int]] = None,
        top_logprobs_num: Optional[Union[List[int], int]] = None,
        token_ids_logprob: Optional[Union[List[List[int]], List[int]]] = None,
        lora_path: Optional[List[Optional[str]]] = None,
        custom_logit_processor: Optional[Union[List[str], str]] = None,
        require_reasoning: bool = False,
        return_hidden_states: bool = False,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
        stream: bool = False,
        bootstrap_host: Any = None,
        bootstrap_port: Any = None,
        bootstrap_room: Any = None,
        routed_dp_rank: Any = None,
        disagg_prefill_dp_rank: Any = None,
        kv_hints: Any = None,
        data_parallel_rank: Optional[int] = None,
        external_trace_header: Optional[Dict] = None,
        rid: Optional[Union[List[str], str]] = None,
        session_params: Any = None,
        priority: Any = None,
        session_id: Any = None,
        *,
        cache_salt: Any = None,
    ) -> Any:
        """:545-648: one dict (or a list for n > 1); with ``stream=True`` the async generator."""
        if image_data is not None or audio_data is not None or video_data is not None:
            raise NotImplementedError("stand-in: multimodal inputs are not modelled")
        self.calls.append({"prompt": prompt, "input_ids": copy.copy(input_ids),
                           "sampling_params": copy.deepcopy(sampling_params), "return_logprob": return_logprob,
                           "lora_path": lora_path, "rid": rid, "stream": stream})
        obj = GenerateReqInput(
            text=prompt, input_ids=input_ids, sampling_params=sampling_params, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            token_ids_logprob=token_ids_logprob, lora_path=lora_path, custom_logit_processor=custom_logit_processor,
            stream=stream, data_parallel_rank=data_parallel_rank, return_routed_experts=return_routed_experts,
            rid=rid)
        generator = self.tokenizer_manager.generate_request(obj, None)
        if stream is True:
            return generator
        return await generator.__anext__()

    # The sync wrappers (:1609-1841): ``self.loop.run_until_complete(...)``; inside a running loop
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
        return self._run_sync(self.tokenizer_manager.release_memory_occupation(
            ReleaseMemoryOccupationReqInput(tags=tags), None))

    def resume_memory_occupation(self, tags: Optional[List[str]] = None):
        return self._run_sync(self.tokenizer_manager.resume_memory_occupation(
            ResumeMemoryOccupationReqInput(tags=tags), None))

    def get_server_info(self) -> Dict[str, Any]:
        internal_states = self._run_sync(self.tokenizer_manager.get_internal_state())
        return {**self.server_args.as_dict(), "internal_states": internal_states, "version": "0.5.23-standin"}

    def get_all_child_pids(self) -> List[int]:
        """:398-400."""
        return list(self.standin_options.child_pids)

    def kill_process_tree(self, include_parent: bool = True) -> None:
        """utils/common.py:2507-2564 on this process: SIGKILL every descendant (and itself)."""
        victims = _descendants(os.getpid())
        self.killed += victims
        if self.standin_options.kill_for_real:
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if include_parent:
                os.kill(os.getpid(), signal.SIGKILL)

    def shutdown(self) -> None:
        """:1450-1497: blocks while it SIGKILLs every descendant of this process (up to 60 s, then
        RuntimeError); no ShutdownReq; the tokenizer manager's tasks keep running."""
        self.shutdown_calls += 1
        self.kill_process_tree(include_parent=False)
        time.sleep(self.standin_options.shutdown_s)
