"""``sglang/srt/managers/scheduler.py`` (0.5.23) and its weight updater, as an asyncio task.

One tick of its loop is one forward pass for every running request. What it keeps of the real
scheduler: the inbox processed at the top of each iteration; abort by rid *prefix* in the waiting
queue and the running batch (:5688, :5800); the silent ``max_new_tokens`` clamp
(``init_req_max_new_tokens``, :2693-2740) before the input-length check
(``validate_input_length``, managers/utils.py:259-289, called at :3246-3254); the queue limit
(``_abort_on_queued_limit``, :3584-3592); per-token weight versions (utils/weight_versions.py);
and the memory bookkeeping of managers/scheduler_components/weight_updater.py (release asserts an
idle scheduler, :339-341; resume removes each tag from a set, :390). An exception there kills the
real scheduler, which SIGQUITs its parent (:6370-6373): here it is recorded in ``crash`` and the
awaiting call raises :class:`SchedulerCrash`, so a test can see the adapter never gets there.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from http import HTTPStatus
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, List, Optional

from .io_struct import (
    AbortReq,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    UpdateWeightFromDiskReqInput,
)
from .schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine

log = logging.getLogger("tests.sglang_standin")

GPU_MEMORY_ALL_TYPES = ["kv_cache", "weights", "cuda_graph"]  # constants.py:2-10


class SchedulerCrash(RuntimeError):
    """The real scheduler process would have died here and SIGQUIT the worker (scheduler.py:6370-6373)."""


def default_token_fn(prompt_ids: List[int], position: int, seed: Any, vocab: int) -> int:
    digest = hashlib.blake2b(f"{tuple(prompt_ids)}|{seed}|{position}".encode(), digest_size=8).digest()
    return 3 + int.from_bytes(digest, "big") % (vocab - 3)


def token_logprob(token: int, position: int) -> float:
    return -round(((token * 2654435761 + position * 97) % 1000) / 250.0 + 0.001, 6)


def weight_version_spans(versions: List[str], current: str) -> List[dict]:
    """utils/weight_versions.py:66-107: contiguous half-open ranges ``[start, end)`` of equal versions
    over the output tokens, at least one (``{"version": cur, "start": 0, "end": 0}`` with no token)."""
    if not versions:
        return [{"version": current, "start": 0, "end": 0}]
    spans: List[dict] = []
    for i, version in enumerate(versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": version, "start": i, "end": i + 1})
    return spans


class StandInScheduler:
    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self.options = engine.standin_options
        self.server_args = engine.server_args
        self.waiting_queue: List[Req] = []
        self.running: List[Req] = []
        self.inbox: List[Any] = []
        self.max_running_requests = self.server_args.max_running_requests
        self.max_queued_requests = self.server_args.max_queued_requests
        self.forward_passes = 0
        self.aborts_received: List[AbortReq] = []
        self.weight_version = str(self.server_args.weight_version)
        self.offload_tags: set = set()
        self.crash: Optional[BaseException] = None
        self._wake = asyncio.Event()
        self._seen_prompts: List[tuple] = []

    @property
    def tm(self) -> Any:
        return self.engine.tokenizer_manager

    def send(self, obj: Any) -> None:
        """``send_to_scheduler.send_pyobj``: processed at the top of the next loop iteration."""
        self.inbox.append(obj)
        self._wake.set()

    async def run(self) -> None:
        try:
            await self._loop()
        except Exception as exc:  # a stand-in bug: loud, and no request waits forever for it
            log.exception("stand-in scheduler crashed")
            self.crash = exc
            for state in list(self.tm.rid_to_state.values()):
                state.finished = True
                state.out_list.append({"output_ids": [], "meta_info": {"finish_reason": {
                    "type": "abort", "status_code": 500, "message": f"stand-in scheduler crashed: {exc!r}"}}})
                state.event.set()
            raise

    async def _loop(self) -> None:
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

    # ------------------------------------------------------------------ inputs

    def _process_inbox(self) -> None:
        inbox, self.inbox = self.inbox, []
        for obj in inbox:
            if isinstance(obj, AbortReq):
                self.abort_request(obj)
            else:
                self.handle_generate_request(obj)

    def handle_generate_request(self, tokenized: SimpleNamespace) -> None:
        req = Req(tokenized.rid, tokenized.input_ids, tokenized.sampling_params, tokenized.return_logprob,
                  tokenized.lora_path, self._cached_prefix(tokenized.input_ids), stream=tokenized.stream)
        self.init_req_max_new_tokens(req)
        limit = self.tm.max_req_input_len
        if len(req.origin_input_ids) >= limit:  # managers/utils.py:272
            req.set_finish_with_abort(
                f"Input length ({len(req.origin_input_ids)} tokens) exceeds the maximum allowed length "
                f"({limit} tokens). Use a shorter input or enable --allow-auto-truncate.")
        elif self.options.inject_error is not None:
            err = self.options.inject_error(req.rid)
            if err is not None:
                status, message = err
                req.to_finish = FINISH_ABORT(message, int(status),
                                             "BadRequestError" if status < 500 else "InternalServerError")
        self._add_request_to_queue(req)

    def init_req_max_new_tokens(self, req: Req) -> None:
        """:2693-2740: ``max_new_tokens = max(0, min(requested, max_req_len - input_len - 1))``, with
        ``max_req_len = max_req_input_len + 5`` (tp_worker.py:568-572), written back silently."""
        sp = req.sampling_params
        requested = sp.get("max_new_tokens", 128)
        requested = 1 << 30 if requested is None else requested
        max_req_len = self.tm.max_req_input_len + 5
        sp["max_new_tokens"] = max(0, min(requested, max_req_len - len(req.origin_input_ids) - 1))
        if sp.get("min_new_tokens", 0) > sp["max_new_tokens"]:
            sp["min_new_tokens"] = sp["max_new_tokens"]

    def _add_request_to_queue(self, req: Req) -> None:
        if self.max_queued_requests is not None and len(self.waiting_queue) + 1 > self.max_queued_requests:
            self.tm._handle_abort_req(AbortReq(rid=req.rid, finished_reason={
                "type": "abort", "status_code": HTTPStatus.SERVICE_UNAVAILABLE, "message": "The request queue is full."}))
            return
        self.waiting_queue.append(req)

    def abort_request(self, recv_req: AbortReq) -> None:
        """PREFIX match (``req.rid.startswith(recv_req.rid)``), waiting queue then running batch."""
        self.aborts_received.append(recv_req)
        to_del = [i for i, req in enumerate(self.waiting_queue)
                  if recv_req.abort_all or req.rid.startswith(recv_req.rid)]
        for i in reversed(to_del):
            req = self.waiting_queue.pop(i)  # "Abort method 1: directly pop from the queue"
            self.tm._handle_abort_req(AbortReq(rid=req.rid))
        for req in self.running:
            if not req.finished() and (recv_req.abort_all or req.rid.startswith(recv_req.rid)):
                # "Abort method 3: set `to_finish`. The request will still run one decode forward pass."
                req.to_finish = FINISH_ABORT()

    # ------------------------------------------------------------------ the forward pass

    def _admit(self) -> None:
        cap = self.max_running_requests
        while self.waiting_queue and (cap is None or len(self.running) < cap):
            self.running.append(self.waiting_queue.pop(0))

    def _next_token(self, req: Req) -> int:
        sp = req.sampling_params
        position = len(req.output_ids)
        seed = sp.get("sampling_seed")
        if not self.server_args.enable_deterministic_inference:
            seed = None  # sampling_batch_info.py:157-172: a seed is ignored without deterministic inference
        elif seed is None:
            seed = 42  # ... and with it, an unseeded request gets 42
        token_fn = self.options.token_fn or default_token_fn
        vocab = self.tm.model_config.vocab_size
        source = seed if seed is not None else req.rid
        token = token_fn(req.prompt_ids, position, source, vocab)
        if position < sp.get("min_new_tokens", 0):  # stop tokens are masked before min_new_tokens
            stops = set(sp.get("stop_token_ids") or ()) | (set() if sp.get("ignore_eos") else self._eos_ids())
            salt = 0
            while token in stops:
                salt += 1
                token = token_fn(req.prompt_ids, position, f"{source}*{salt}", vocab)
        return token

    def _eos_ids(self) -> set:
        return set(self.tm.model_config.hf_eos_token_id or ())

    def _forward(self) -> None:
        self.forward_passes += 1
        tm = self.tm
        finished: List[Req] = []
        for req in self.running:
            if req.sampling_params.get("max_new_tokens", 128) == 0 and req.to_finish is None:
                req.finished_reason = FINISH_LENGTH(length=0)  # the prefix-caching request of n > 1
            else:
                token = self._next_token(req)
                req.output_ids.append(token)
                req.output_logprobs.append(token_logprob(token, len(req.output_ids) - 1))
                req.output_versions.append(self.weight_version)
                req.update_finish_state(tm.tokenizer, self._eos_ids())
            if req.finished():
                finished.append(req)
            elif req.stream:
                tm._handle_stream_output(req)
        if finished:
            self.running = [r for r in self.running if not r.finished()]
            for req in finished:
                tm._handle_batch_output(req, weight_version_spans(req.output_versions, self.weight_version))

    def _cached_prefix(self, ids: List[int]) -> int:
        """Toy radix cache: the longest common prefix with an earlier prompt, at most len - 1."""
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

    def is_fully_idle(self) -> bool:
        """scheduler.py:5337: nothing running, nothing waiting."""
        return not self.running and not self.waiting_queue and not self.inbox

    # ------------------------------------------------------------------ weight updater

    def _crash(self, exc: BaseException) -> None:
        self.crash = exc
        log.error("stand-in scheduler hit an exception (the real one dies and SIGQUITs the worker): %r", exc)
        raise SchedulerCrash(repr(exc)) from exc

    def update_weights_from_disk(self, obj: UpdateWeightFromDiskReqInput) -> SimpleNamespace:
        if obj.model_path in self.options.bad_weight_paths:
            return SimpleNamespace(success=False, num_paused_requests=0,
                                   message=f"Failed to get weights iterator: {obj.model_path} (stand-in failure).")
        if obj.weight_version is not None:
            self.weight_version = obj.weight_version  # record_weight_version_change (scheduler.py:5636-5641)
        return SimpleNamespace(success=True, message="Succeeded to update model weights.", num_paused_requests=0)

    def release_memory_occupation(self, obj: ReleaseMemoryOccupationReqInput) -> None:
        """weight_updater.py:337-381."""
        try:
            assert self.is_fully_idle(), "release_memory_occupation should be called only when server is idle."
        except AssertionError as exc:
            self._crash(exc)
        for tag in obj.tags or GPU_MEMORY_ALL_TYPES:
            self.offload_tags.add(tag)

    def resume_memory_occupation(self, obj: ResumeMemoryOccupationReqInput) -> None:
        """weight_updater.py:383-422 (``self.offload_tags.remove(tag)`` at :390)."""
        for tag in obj.tags or GPU_MEMORY_ALL_TYPES:
            try:
                self.offload_tags.remove(tag)
            except KeyError as exc:
                self._crash(exc)
