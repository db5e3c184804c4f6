"""The SGLang adapter's weights and memory: loads from disk, a trainer's push, tensors from this
process, in-place swaps, memory release (a mixin of :class:`.sglang_engine.SGLangEngine`).

References are to files under ``sglang/srt/`` of sglang 0.5.23, as in :mod:`.sglang_engine`; every
name used here is listed in :mod:`.sglang_contract`. Weights and memory are awaited on the
tokenizer manager with io_struct inputs: the Engine's sync wrappers use ``loop.run_until_complete``
(engine.py:1702-1720, :1831-1841) and fail inside the worker's running loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import sys
from typing import Any, Callable, Sequence

from redroll.engine_worker.engines.base import EngineCommandRefused, EngineInfo, WeightUpdateError
from redroll.engine_worker.engines.sglang_contract import MEMORY_TAGS

log = logging.getLogger(__name__)




class SGLangWeights:
    """Mixin: the weight and memory commands of :class:`.sglang_engine.SGLangEngine` (whose
    ``__init__`` sets the attributes below)."""

    engine: Any
    info: EngineInfo
    pause_mode: str
    memory_saver: bool
    loaded_model_path: str
    cache_flushes: int
    _engine_factory: Callable[..., Any] | None
    _dp_size: int
    _group_name: str | None
    _live_changed: bool
    _released_tags: set[str]
    _dispatch_open: asyncio.Event
    _flush_task: asyncio.Task | None
    _require_engine: Callable[[], Any]

    # ------------------------------------------------------------------ weights from disk

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



def _update_result(result: Any) -> tuple[bool, str]:
    """``(success, message, num_paused_requests)`` (0.5.23), ``(success, message)``, or an object."""
    if isinstance(result, tuple):
        success = bool(result[0]) if result else False
        message = str(result[1]) if len(result) > 1 else ""
        return success, message
    if hasattr(result, "success"):
        return bool(result.success), str(getattr(result, "message", ""))
    return bool(result), ""
