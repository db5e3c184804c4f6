"""Engine adapters. Heavy ones (transformers, sglang) import their libraries lazily."""

from __future__ import annotations

from typing import Any

from redroll.engine_worker.engines.base import Engine, EngineInfo, EngineOutput, SampleOutput

ENGINE_NAMES = ("vllm", "sglang", "transformers", "synthetic")


def create_engine(name: str, **options: Any) -> Engine:
    """Build an engine by name; options are the engine's own keyword arguments."""
    if name == "synthetic":
        from redroll.engine_worker.engines.synthetic import SyntheticEngine

        return SyntheticEngine(**options)
    if name == "transformers":
        from redroll.engine_worker.engines.transformers_engine import TransformersEngine

        return TransformersEngine(**options)
    if name == "vllm":
        from redroll.engine_worker.engines.vllm_engine import VLLMEngine

        return VLLMEngine(**options)
    if name == "sglang":
        from redroll.engine_worker.engines.sglang_engine import SGLangEngine

        return SGLangEngine(**options)
    raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}")


__all__ = ["ENGINE_NAMES", "Engine", "EngineInfo", "EngineOutput", "SampleOutput", "create_engine"]
