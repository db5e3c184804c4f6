"""Weights and memory of the vLLM engine: new weights from disk, in place or between requests,
and the refusal of a memory release that would free nothing.

* **From disk**: ``collective_rpc("reload_weights", kwargs={"weights_path": ...})`` reloads the
  model's weights in place in every model worker (vLLM's documented way for RL trainers).
* **In place** (``in_place=True``, a worker's ``--pause-mode``): generation is paused around the
  load and goes on afterwards. ``in_place`` pauses with ``mode="keep", clear_cache=False``:
  running requests keep the KV cache computed with the old weights and continue on the new ones
  (their records carry per-token weight versions); ``retract`` pauses with ``clear_cache=True``:
  their KV cache is dropped and recomputed under the new weights. Either way every request is
  salted with the weight version it starts under (``cache_salt``), so none reuses KV made by
  other weights, without a prefix-cache reset (which vLLM refuses while requests hold blocks).
* **A trainer's push** (``producer.weight_sync``, torch.distributed): this worker process joins the
  trainer's group (one rank, whatever the tensor-parallel size) and receives the broadcast into
  staging buffers; the engine keeps serving. On the trainer's commit the staged tensors are written
  to one safetensors file in shared memory and every vLLM model worker loads it in place through
  :class:`~.vllm_extension.RedrollWorkerExtension` (tensors as ``collective_rpc`` arguments do not
  work on the CPU build). A push must carry every tensor of the checkpoint the engine serves, with
  its shape: vLLM reloads layer by layer and a layer left without all its tensors stays on the
  meta device, which kills the engine, so anything else is received into scratch and refused.
  On GPUs, a push over NCCL is staged on this process's GPU and handed over by CUDA IPC through
  vLLM's own weight-transfer engine (``weight_transfer_config={"backend": "ipc"}``, set by
  default there): written from vLLM's source, contract-tested, untested on hardware.
* **Memory release** (``sleep``/``wake_up``, colocated training) needs an engine started with
  sleep mode, which vLLM supports on GPUs only; on CPU ``AsyncLLM.sleep()`` succeeds, frees
  nothing and aborts everything in flight, so redroll refuses the release there before touching
  the engine. The GPU path (``sleep(level)`` / ``wake_up(tags)``) is written from vLLM's source and
  is untested on hardware.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from redroll.engine_worker.engines.base import EngineCommandRefused, WeightUpdateError
from redroll.engine_worker.engines.weight_group_member import WeightGroupMember
from redroll.shared.weight_group import joined, torch_dtype

if TYPE_CHECKING:  # pragma: no cover
    from redroll.engine_worker.engines.base import EngineInfo
    from redroll.engine_worker.engines.vllm_process import VLLMProcess

log = logging.getLogger(__name__)

MEMORY_TAGS = ("weights", "kv_cache")
"""What vLLM's ``wake_up(tags)`` takes back (level 1 sleep offloads weights, discards the KV cache)."""


class VLLMWeights(WeightGroupMember):
    """Mixed into :class:`~.vllm_engine.VLLMEngine` (which sets ``process``, ``info``, ``pause_mode``)."""

    process: "VLLMProcess"
    info: "EngineInfo"
    pause_mode: str
    loaded_model_path: str
    _released: bool = False
    _staged: "tuple[str, dict[str, Any], bool] | None" = None
    _ipc_ready: bool = False

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                       load_format: str | None = None, *, in_place: bool = False) -> str:
        """Load ``model_path``'s weights. Without ``in_place`` the worker has quiesced first (nothing
        runs); with it, running requests are paused for the load and go on afterwards."""
        llm = self.process.require()
        if load_format not in (None, "auto", "safetensors"):
            raise WeightUpdateError(f"the vllm engine reloads checkpoint files, not load_format {load_format!r}")
        paused = False
        if in_place:
            await llm.pause_generation(mode="keep", clear_cache=self.pause_mode == "retract")
            paused = True
        try:
            try:
                await llm.collective_rpc("reload_weights", kwargs={"weights_path": model_path})
            except Exception as exc:
                raise WeightUpdateError(f"reload_weights({model_path!r}) failed: {type(exc).__name__}: {exc}") from exc
            version = weight_version or self.info.weight_version
            await llm.update_weight_version(str(version))
        finally:
            if paused:
                await llm.resume_generation()
        self.loaded_model_path = model_path
        self.info.weight_version = str(version)
        return f"reloaded {model_path}"

    # ------------------------------------------------------------------ a trainer's push

    def _check_can_join(self) -> None:
        self.process.require()

    async def receive_weights(self, specs: Sequence[Any], *, group_name: str, version: str,
                              in_place: bool = True) -> None:
        """Receive the broadcast, in order, into staging (vLLM keeps serving the old weights)."""
        group = joined(self._group, group_name)
        problem = self._incomplete(specs)
        import torch

        device = "cuda" if group.backend == "nccl" else "cpu"  # (NCCL: staged on this GPU, handed over by IPC)
        buffers = [(spec.name, torch.empty(list(spec.shape), dtype=torch_dtype(spec.dtype), device=device))
                   for spec in specs]

        # (an incomplete push is still received, into scratch: the collective stays in step and the
        # trainer hears why this worker refused it, instead of a connection closed by a peer)
        await asyncio.to_thread(group.receive, [tensor for _, tensor in buffers])
        if problem is not None:
            raise WeightUpdateError(problem)
        self._staged = (version, dict(buffers), in_place)

    def _incomplete(self, specs: Sequence[Any]) -> str | None:
        """Why ``specs`` is not every tensor of the served checkpoint, each with its shape (None: it is)."""
        want = checkpoint_shapes(self.loaded_model_path)
        got = {spec.name: tuple(spec.shape) for spec in specs}
        missing = sorted(set(want) - set(got))
        unknown = sorted(set(got) - set(want))
        wrong = sorted(n for n in set(want) & set(got) if want[n] != got[n])
        if not (missing or unknown or wrong):
            return None
        parts = [f"{label}: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
                 for label, names in (("missing", missing), ("not in the checkpoint", unknown),
                                      ("other shape", wrong)) if names]
        return ("a push to a vllm worker must carry every tensor of its checkpoint with its shape "
                f"({len(want)} tensors); " + "; ".join(parts))

    async def commit_weights(self, version: str) -> None:
        """Hand the staged tensors to vLLM (in place: generation paused around the load): CPU tensors
        through a file in shared memory, CUDA tensors (an NCCL push) through CUDA IPC."""
        staged, self._staged = self._staged, None
        if staged is None or staged[0] != version:
            raise RuntimeError(f"no staged weights for version {version!r}")
        llm = self.process.require()
        _, tensors, in_place = staged
        on_gpu = any(getattr(t, "is_cuda", False) for t in tensors.values())
        if in_place:
            await llm.pause_generation(mode="keep", clear_cache=self.pause_mode == "retract")
        try:
            if on_gpu:
                await self._load_by_ipc(llm, tensors, str(version))
            else:
                await self._load_from_file(llm, tensors)
                await llm.update_weight_version(str(version))
        finally:
            if in_place:
                await llm.resume_generation()
        self.info.weight_version = str(version)

    async def _load_from_file(self, llm: Any, tensors: dict[str, Any]) -> None:
        directory = tempfile.mkdtemp(prefix="redroll-push-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        try:
            path = str(Path(directory) / "weights.safetensors")
            await asyncio.to_thread(_save, tensors, path)
            await llm.collective_rpc("redroll_load_weights", kwargs={"path": path})
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    async def _load_by_ipc(self, llm: Any, tensors: dict[str, Any], version: str) -> None:
        """vLLM's own weight-transfer engine, IPC backend (started with ``weight_transfer_config``
        ``{"backend": "ipc"}`` on GPUs): each of its model workers rebuilds every tensor from the CUDA
        IPC handle made for its GPU (copies on every GPU this process sees) and loads it in place.
        Written from vLLM's source (distributed/weight_transfer/ipc_engine.py); untested on hardware."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest

        handles, keep_alive = await asyncio.to_thread(ipc_handles, list(tensors.values()))
        update_info = {"names": list(tensors), "dtype_names": [str(t.dtype).removeprefix("torch.")
                                                               for t in tensors.values()],
                       "shapes": [list(t.shape) for t in tensors.values()], "ipc_handles": handles}
        if not self._ipc_ready:
            await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={"packed": False}))
            self._ipc_ready = True
        await llm.start_weight_update()
        await llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))
        await llm.finish_weight_update(weight_version=version)
        del keep_alive  # (the copies live until every worker loaded them)

    async def discard_weights(self) -> bool:
        """Drop the staged tensors; vLLM was not touched (True: it serves its version still)."""
        self._staged = None
        return True

    # ------------------------------------------------------------------ memory

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free the engine's memory (vLLM ``sleep``): GPU engines started with sleep mode only."""
        self.process.require()
        if self.process.on_cpu:
            raise EngineCommandRefused("vLLM frees no memory on CPU (it has no sleep mode there, and its sleep() "
                                       "would abort every request in flight): nothing was released")
        if not self.process.enable_sleep_mode:
            raise EngineCommandRefused("releasing memory needs vLLM's sleep mode: start the worker with "
                                       "--enable-memory-saver")
        if self._released:
            raise EngineCommandRefused("the engine's memory is released already; resume it first")
        unknown = sorted(set(tags or ()) - set(MEMORY_TAGS))
        if unknown:
            raise EngineCommandRefused(f"unknown memory tag(s) {unknown}; vLLM has {list(MEMORY_TAGS)}")
        await self.process.require().sleep(level=1, mode="wait")
        self._released = True

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        llm = self.process.require()
        if not self._released:
            raise EngineCommandRefused("no engine memory is released: nothing to resume")
        awake = await llm.wake_up(tags=list(tags) if tags else None)
        if not tags and not awake:  # (vLLM returns whether every tag is back)
            raise EngineCommandRefused("vLLM did not take all of its memory back (wake_up returned False)")
        self._released = bool(tags) and not awake

    @property
    def released_tags(self) -> list[str]:
        return list(MEMORY_TAGS) if self._released else []


def checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the ``*.safetensors`` files of ``model_path`` (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise WeightUpdateError(f"{model_path} has no .safetensors files: a push cannot be checked against it")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def ipc_handles(tensors: Sequence[Any]) -> tuple[list[dict[str, tuple]], list[Any]]:
    """Per tensor, ``{GPU UUID: rebuild_cuda_tensor args}`` for every GPU this process sees (a copy
    on each GPU that does not hold it), as vLLM's IPC weight-transfer engine reads them; and the
    copies, which must stay alive until vLLM loaded them."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    devices = range(torch.cuda.device_count())
    uuids = {d: str(torch.cuda.get_device_properties(d).uuid) for d in devices}
    handles, copies = [], []
    for tensor in tensors:
        per_gpu = {}
        for d in devices:
            on_d = tensor if tensor.device.index == d else tensor.to(f"cuda:{d}")
            copies.append(on_d)
            per_gpu[uuids[d]] = tuple(reduce_tensor(on_d)[1])
        handles.append(per_gpu)
    return handles, copies


def _save(tensors: dict[str, Any], path: str) -> None:
    from safetensors.torch import save_file

    save_file({name: t.contiguous() for name, t in tensors.items()}, path)


__all__ = ["MEMORY_TAGS", "VLLMWeights", "checkpoint_shapes", "ipc_handles"]
