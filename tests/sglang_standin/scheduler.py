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
    BeginWeightUpdateReqInput,
    ContinueGenerationReqInput,
    DestroyWeightsUpdateGroupReqInput,
    EndWeightUpdateReqInput,
    InitWeightsUpdateGroupReqInput,
    PauseGenerationReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
)
from .schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req
from .utils import MultiprocessingSerializer, init_custom_process_group

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
        self._step = asyncio.Lock()
        """Held for one forward pass or one control request: the real scheduler does one at a time."""
        self.engine_paused = False  # scheduler.py:1348 ``_engine_paused``
        self.weights: dict = {}
        """The model's tensors as the last weight update left them (name -> tensor)."""
        self.groups: dict = {}  # model_runner_components/weight_updater.py:98 ``_model_update_group``
        self.session: Optional[str] = None  # scheduler_components/weight_updater.py ``_session``
        self.session_loaded = False
        self.flushes = 0
        self.pauses: List[str] = []

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
            if not (self.inbox or self.waiting_queue or self.running) and not self.engine_paused:
                self._wake.clear()
                await self._wake.wait()
            if self.engine_paused:  # inputs (aborts) are handled; nothing runs until continue_generation
                self._wake.clear()
                async with self._step:
                    self._process_inbox()
                await self._wake.wait()
                continue
            async with self._step:
                self._process_inbox()
                self._admit()
                if self.running:
                    await asyncio.sleep(self.options.token_delay_s)  # the forward pass
                    self._forward()
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

    def is_fully_idle(self, ignore_waiting: bool = False) -> bool:
        """scheduler.py:5337: nothing running, nothing waiting (unless ``ignore_waiting``)."""
        return not self.running and (ignore_waiting or (not self.waiting_queue and not self.inbox))

    async def control(self, fn: Any) -> Any:
        """A control request, between two forward passes (the scheduler blocks while it runs)."""
        async with self._step:
            result = fn()
            if asyncio.iscoroutine(result):
                result = await result
            return result

    def flush_cache(self, empty_cache: bool = True) -> bool:
        """scheduler.py:5518-5547: only when idle (waiting requests ignored while paused)."""
        if not self.is_fully_idle(ignore_waiting=self.engine_paused):
            log.warning("Cache not flushed because there are pending requests. #queue-req: %d, #running-req: %d",
                        len(self.waiting_queue), len(self.running))
            return False
        self._seen_prompts.clear()
        self.flushes += 1
        return True

    def pause_generation(self, recv_req: PauseGenerationReqInput) -> None:
        """scheduler.py:5817-5931: in_place keeps the running batch; retract puts it back in the
        waiting queue (its KV freed, recomputed on continue)."""
        assert recv_req.mode in ("in_place", "retract")
        self.engine_paused = True
        self.pauses.append(recv_req.mode)
        if recv_req.mode == "retract":
            for req in reversed([r for r in self.running if not r.finished()]):
                req.retraction_count += 1
                self.waiting_queue.insert(0, req)
            self.running = []

    def continue_generation(self, recv_req: ContinueGenerationReqInput) -> None:
        """scheduler.py:5934-5957."""
        self.engine_paused = False
        self._wake.set()

    # ------------------------------------------------------------------ weight updater

    def _crash(self, exc: BaseException) -> None:
        self.crash = exc
        log.error("stand-in scheduler hit an exception (the real one dies and SIGQUITs the worker): %r", exc)
        raise SchedulerCrash(repr(exc)) from exc

    def update_weights_from_disk(self, obj: UpdateWeightFromDiskReqInput) -> SimpleNamespace:
        """weight_updater.py:138-163 (no session needed)."""
        if obj.model_path in self.options.bad_weight_paths:
            return SimpleNamespace(success=False, num_paused_requests=0,
                                   message=f"Failed to get weights iterator: {obj.model_path} (stand-in failure).")
        if obj.weight_version is not None:
            self.weight_version = obj.weight_version  # record_weight_version_change (scheduler.py:5636-5641)
        success, message = self._flush_after_update(obj, True, "Succeeded to update model weights.")
        return SimpleNamespace(success=success, message=message, num_paused_requests=0)

    def _flush_after_update(self, obj: Any, success: bool, message: str) -> tuple:
        """weight_updater.py:120-133: a refused flush fails the call, after the weights were loaded."""
        if obj.flush_cache and not self.flush_cache():
            return False, ("Weights were updated, but the cache was not flushed because requests are still "
                           "running or queued. Retract or finish them, then call /flush_cache.")
        return success, message

    # a trainer's push (model_executor/model_runner_components/weight_updater.py and
    # managers/scheduler_components/weight_updater.py)

    async def init_weights_update_group(self, obj: InitWeightsUpdateGroupReqInput) -> SimpleNamespace:
        """model_runner_components/weight_updater.py:100-141 (rank = rank_offset + tp_rank)."""
        import datetime

        def join() -> Any:
            return init_custom_process_group(
                backend=obj.backend, init_method=f"tcp://{obj.master_address}:{obj.master_port}",
                world_size=obj.world_size, rank=obj.rank_offset + 0, group_name=obj.group_name,
                timeout=datetime.timedelta(seconds=self.options.group_timeout_s))

        try:
            self.groups[obj.group_name] = await asyncio.to_thread(join)
        except Exception as e:
            return SimpleNamespace(success=False, message=f"Failed to initialize custom process group: {e}.")
        return SimpleNamespace(success=True, message="Succeeded to initialize custom process group.")

    def destroy_weights_update_group(self, obj: DestroyWeightsUpdateGroupReqInput) -> SimpleNamespace:
        """model_runner_components/weight_updater.py:143-155."""
        import torch.distributed as dist

        try:
            if obj.group_name in self.groups:
                dist.destroy_process_group(self.groups.pop(obj.group_name))
                return SimpleNamespace(success=True, message="Succeeded to destroy custom process group.")
            return SimpleNamespace(success=False, message="The group to be destroyed does not exist.")
        except Exception as e:
            return SimpleNamespace(success=False, message=f"Failed to destroy custom process group: {e}.")

    def begin_weight_update(self, obj: BeginWeightUpdateReqInput) -> SimpleNamespace:
        """weight_updater.py:309-321."""
        if self.session is not None:
            return SimpleNamespace(success=False, message="a weight-update session is already open; "
                                                          "call end_weight_update() first")
        self.session, self.session_loaded = obj.selector, False
        return SimpleNamespace(success=True, message="Success")

    def end_weight_update(self, obj: EndWeightUpdateReqInput) -> SimpleNamespace:
        """weight_updater.py:323-335."""
        if self.session is None:
            return SimpleNamespace(success=False, message="no weight-update session is open; "
                                                          "call begin_weight_update() first")
        self.session = None
        return SimpleNamespace(success=True, message="Success")

    async def update_weights_from_distributed(self, obj: UpdateWeightsFromDistributedReqInput) -> SimpleNamespace:
        """weight_updater.py:186-232: receive every tensor (one broadcast each from rank 0,
        model_runner_components/weight_updater.py:260-298), then load; the version is recorded and
        the cache flushed (unless ``flush_cache`` is false) only on success."""
        import torch
        import torch.distributed as dist

        if self.session is None:  # :192-197
            return SimpleNamespace(success=False, message="update_weights_from_distributed must run between "
                                                          "begin_weight_update() and end_weight_update()")
        group = self.groups.get(obj.group_name)
        assert group is not None, f"Group {obj.group_name} not in {list(self.groups)}. " \
                                  "Please call `init_weights_update_group` first."

        def receive() -> list:
            weights, handles = [], []
            for name, dtype, shape in zip(obj.names, obj.dtypes, obj.shapes):
                weight = torch.empty(shape, dtype=getattr(torch, dtype))
                handles.append(dist.broadcast(weight, src=0, group=group, async_op=True))
                weights.append((name, weight))
            for handle in handles:
                handle.wait()
            return weights

        try:
            weights = await asyncio.to_thread(receive)
        except Exception as e:
            return SimpleNamespace(success=False, message=f"Failed to receive weights: {e}")
        return self._after_load(obj, *self._load(weights))

    def update_weights_from_tensor(self, obj: UpdateWeightsFromTensorReqInput) -> SimpleNamespace:
        """weight_updater.py:234-263: this rank's payload deserialized, then loaded."""
        if self.session is None:  # :234-239
            return SimpleNamespace(success=False, message="update_weights_from_tensor must run between "
                                                          "begin_weight_update() and end_weight_update()")
        named = MultiprocessingSerializer.deserialize(obj.serialized_named_tensors[0])
        return self._after_load(obj, *self._load([(name, tensor.clone()) for name, tensor in named]))

    def _after_load(self, obj: Any, success: bool, message: str) -> SimpleNamespace:
        """A loaded push inside the begin/end bracket: the session holds new weights, the version
        changes when the request names one, and the cache is flushed as the request asks."""
        if success:
            self.session_loaded = True
            if obj.weight_version is not None:
                self.weight_version = obj.weight_version
            success, message = self._flush_after_update(obj, success, message)
        return SimpleNamespace(success=success, message=message)

    def _load(self, weights: list) -> tuple:
        shapes = self.options.param_shapes
        for name, tensor in weights:
            if shapes is not None and tuple(shapes.get(name, ())) != tuple(tensor.shape):
                return False, f"Failed to update weights: {name} {tuple(tensor.shape)} does not fit the model"
        self.weights.update(weights)
        return True, "Succeeded to update parameter online."

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
