"""Engine adapters behind one contract (:mod:`.base`), registered in :mod:`.registry`. Heavy
libraries (torch, transformers, vllm, sglang) are imported lazily, inside the adapters."""

from __future__ import annotations

from redroll.engine_worker.engines.base import Engine, EngineInfo, EngineOutput, SampleOutput
from redroll.engine_worker.engines.registry import ENGINE_NAMES, ENGINES, create_engine, engine_spec

__all__ = ["ENGINES", "ENGINE_NAMES", "Engine", "EngineInfo", "EngineOutput", "SampleOutput", "create_engine",
           "engine_spec"]
