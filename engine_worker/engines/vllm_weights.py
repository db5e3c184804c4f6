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
* **Memory release** (``sleep``/``wake_up``, colocated training) needs an engine started with
  sleep mode, which vLLM supports on GPUs only; on CPU ``AsyncLLM.sleep()`` succeeds, frees
  nothing and aborts everything in flight, so redroll refuses the release there before touching
  the engine. The GPU path (``sleep(level)`` / ``wake_up(tags)``) is written from vLLM's source and
  is untested on hardware.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .sglang_engine import EngineCommandRefused, WeightUpdateError

if TYPE_CHECKING:  # pragma: no cover
    from .base import EngineInfo
    from .vllm_process import VLLMProcess

log = logging.getLogger(__name__)

MEMORY_TAGS = ("weights", "kv_cache")
"""What vLLM's ``wake_up(tags)`` takes back (level 1 sleep offloads weights, discards the KV cache)."""


class VLLMWeights:
    """Mixed into :class:`~.vllm_engine.VLLMEngine` (which sets ``process``, ``info``, ``pause_mode``)."""

    process: "VLLMProcess"
    info: "EngineInfo"
    pause_mode: str
    loaded_model_path: str
    _released: bool = False

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
        await llm.wake_up(tags=list(tags) if tags else None)
        self._released = False

    @property
    def released_tags(self) -> list[str]:
        return list(MEMORY_TAGS) if self._released else []


__all__ = ["MEMORY_TAGS", "VLLMWeights"]
