"""``redroll worker``: run an engine worker (its flags, the checks before it starts, the run)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any, Sequence

from redroll.cli.burst import add_burst_flag
from redroll.cli.options import (
    SETTING_DEFAULTS,
    add_connection_options,
    non_negative_int,
    positive_gib,
    settings_from_args,
)
from redroll.cli.process import serve
from redroll.shared.settings import RECOVERY_SPLITS, Settings

ENGINES = ["vllm", "sglang", "transformers", "synthetic"]
"""The engines ``redroll worker --engine`` runs (no default: a worker is told which)."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("worker", help="run an engine worker")
    add_connection_options(p)
    p.add_argument("--engine", choices=ENGINES, default=os.environ.get("REDROLL_ENGINE") or None,
                   help="the engine to run (env REDROLL_ENGINE; required: synthetic makes fake tokens, for tests)")
    p.add_argument("--model-path", default=os.environ.get("REDROLL_MODEL_PATH", "tiny-random"),
                   help="local model directory (env REDROLL_MODEL_PATH), or for transformers 'tiny-random', "
                        "the built-in tiny model")
    p.add_argument("--max-inflight", type=int, default=int(os.environ.get("REDROLL_MAX_INFLIGHT", "32")),
                   help="requests in the engine at once (enough for it to batch; for a continuous-batching "
                        "engine about 2x its capacity keeps it busy while finished work is published)")
    p.add_argument("--only-partitions", default=os.environ.get("REDROLL_ONLY_PARTITIONS"),
                   help="claim only from these partitions, e.g. 0,2 (env REDROLL_ONLY_PARTITIONS; default: all)")
    p.add_argument("--token-ms", type=float, default=0.0, help="synthetic engine: milliseconds per token")
    p.add_argument("--vocab-size", type=int, default=32000, help="synthetic engine: vocabulary size")
    p.add_argument("--slots", type=int, default=None,
                   help="synthetic engine: continuous-batching capacity (requests generating at once)")
    p.add_argument("--jitter", type=float, default=0.0,
                   help="synthetic engine: per-request token time varies by this fraction")
    p.add_argument("--raise-marker", default=None,
                   help="synthetic engine fault injection: prompts containing this make the engine raise")
    p.add_argument("--exit-marker", default=None,
                   help="synthetic engine fault injection: prompts containing this kill the worker process")
    p.add_argument("--device", default="cpu", help="transformers engine: torch device")
    p.add_argument("--dtype", default=None, help="model dtype (transformers default float32, sglang and vllm default auto)")
    p.add_argument("--max-batch-size", type=int, default=32, help="transformers engine: rows per batch")
    p.add_argument("--prefix-cache-tokens", type=int,
                   default=int(os.environ.get("REDROLL_PREFIX_CACHE_TOKENS", "0")),
                   help="transformers engine: keep the KV of recent prompts and conversations, up to this many "
                        "tokens (env REDROLL_PREFIX_CACHE_TOKENS; default 0 = off); records report "
                        "meta_info.cached_tokens")
    p.add_argument("--weight-version", default=None,
                   help="the weight_version the worker's records carry at start (default: the engine's)")
    g = p.add_argument_group("sglang and vllm engines")
    g.add_argument("--tp-size", type=int, default=int(os.environ.get("REDROLL_SGLANG_TP_SIZE", "1")),
                   help="tensor-parallel size (vllm: tensor_parallel_size)")
    g.add_argument("--dp-size", type=int, default=int(os.environ.get("REDROLL_SGLANG_DP_SIZE", "1")),
                   help="sglang: data-parallel size")
    g.add_argument("--mem-fraction-static", type=float, default=None,
                   help="accelerator memory the engine may take (vllm: gpu_memory_utilization)")
    g.add_argument("--max-running-requests", type=int, default=None,
                   help="requests the engine runs at once (vllm: max_num_seqs)")
    g.add_argument("--context-length", type=int, default=None, help="model context (vllm: max_model_len)")
    g.add_argument("--random-seed", type=int, default=None, help="the engine's random seed")
    g.add_argument("--enable-memory-saver", action="store_true",
                   help="needed for release/resume of GPU memory (colocated training; vllm: enable_sleep_mode, "
                        "GPU only)")
    g.add_argument("--skip-tokenizer-init", action="store_true", help="token ids in and out only")
    g.add_argument("--max-routed-experts-bytes", type=int, default=2 * 1024 * 1024,
                   help="the most MoE routing data (return_routed_experts) one record may carry")
    g.add_argument("--pause-mode", choices=["in_place", "retract"],
                   default=os.environ.get("REDROLL_SGLANG_PAUSE_MODE", "in_place"),
                   help="how an in-place weight update pauses SGLang or vLLM: in_place keeps the KV cache (computed "
                        "with the old weights), retract recomputes it with the new ones")
    g.add_argument("--sglang-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="any other sglang.Engine argument (repeatable); VALUE is parsed as JSON when it can be")
    g = p.add_argument_group("vllm engine")
    g.add_argument("--kv-cache-gib", type=positive_gib, default=None,
                   help="KV cache size in GiB (vllm: kv_cache_memory_bytes; on CPU default 1, or "
                        "VLLM_CPU_KVCACHE_SPACE when set)")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="turn vLLM's prefix cache off (on by default: affinity lanes exist to feed it)")
    g.add_argument("--vllm-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="any other vLLM AsyncEngineArgs argument (repeatable); VALUE is parsed as JSON when it can be")
    p.add_argument("--claim-idle-ms", type=int, default=None,
                   help="take over a request another worker has held this long without progress "
                        f"(env REDROLL_CLAIM_IDLE_MS; default {SETTING_DEFAULTS.claim_idle_ms})")
    p.add_argument("--max-deliveries", type=int, default=None,
                   help="dead-letter a request after this many deliveries "
                        f"(env REDROLL_MAX_DELIVERIES; default {SETTING_DEFAULTS.max_deliveries})")
    p.add_argument("--claim-prefetch", type=non_negative_int, default=None, metavar="N",
                   help="claim what the engine can start now plus N more, so a freed slot is refilled without "
                        "waiting for a claim (env REDROLL_CLAIM_PREFETCH; default "
                        f"{SETTING_DEFAULTS.claim_prefetch}; as large as --max-inflight: claim up to it at once)")
    p.add_argument("--recovery-split", choices=RECOVERY_SPLITS, default=None,
                   help="how the entries of a worker that died are taken back: halving runs them in ever "
                        "smaller groups until a request that kills workers is alone, alone runs each one by "
                        f"itself (env REDROLL_RECOVERY_SPLIT; default {SETTING_DEFAULTS.recovery_split})")
    p.add_argument("--drain-timeout", type=float, default=None,
                   help=f"seconds to finish in-flight work on SIGTERM (env REDROLL_DRAIN_TIMEOUT_S; default "
                        f"{SETTING_DEFAULTS.drain_timeout_s:g})")
    p.add_argument("--name", default=None,
                   help="the worker's name, as status and drain show it (default: host-pid-random, unique per start)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    add_burst_flag(p, "worker")
    p.set_defaults(run=run)


def parse_key_values(pairs: Sequence[str], flag: str = "--sglang-arg") -> dict[str, Any]:
    """``["a=1", "b=true", "c=x"]`` → ``{"a": 1, "b": True, "c": "x"}`` (JSON when it parses)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} {pair!r} must look like KEY=VALUE")
        try:
            out[key.replace("-", "_")] = json.loads(raw)
        except ValueError:
            out[key.replace("-", "_")] = raw
    return out


async def run(args: argparse.Namespace) -> int:
    if refusal := worker_refusal(args):
        print(f"redroll worker: {refusal}", file=sys.stderr)
        return 2
    return await run_worker(args)


def worker_settings(args: argparse.Namespace) -> Settings:
    """The worker's settings: defaults, then ``REDROLL_*`` variables, then its flags."""
    return settings_from_args(args, claim_idle_ms=args.claim_idle_ms, max_deliveries=args.max_deliveries,
                              drain_timeout_s=args.drain_timeout, claim_prefetch=args.claim_prefetch,
                              recovery_split=args.recovery_split)


async def run_worker(args: argparse.Namespace) -> int:
    from redroll.engine_worker.engines import create_engine
    from redroll.engine_worker.worker import Worker

    settings = worker_settings(args)
    options: dict[str, Any] = {}
    if args.engine == "synthetic":
        options = {"token_ms": args.token_ms, "vocab_size": args.vocab_size, "jitter": args.jitter,
                   "slots": args.slots,
                   "raise_marker": args.raise_marker, "exit_marker": args.exit_marker}
    elif args.engine == "transformers":
        options = {"model_path": args.model_path, "device": args.device, "dtype": args.dtype or "float32",
                   "max_batch_size": args.max_batch_size, "prefix_cache_tokens": args.prefix_cache_tokens}
    elif args.engine == "sglang":
        options = {"model_path": args.model_path, "tp_size": args.tp_size, "dp_size": args.dp_size,
                   "mem_fraction_static": args.mem_fraction_static,
                   "max_running_requests": args.max_running_requests, "context_length": args.context_length,
                   "dtype": args.dtype or "auto", "random_seed": args.random_seed,
                   "enable_memory_saver": args.enable_memory_saver,
                   "skip_tokenizer_init": args.skip_tokenizer_init, "pause_mode": args.pause_mode,
                   "checkpoint_stream_interval": settings.checkpoint_tokens,
                   "max_routed_experts_bytes": args.max_routed_experts_bytes,
                   "extra_args": parse_key_values(args.sglang_arg)}
    elif args.engine == "vllm":
        options = {"model_path": args.model_path, "tensor_parallel_size": args.tp_size,
                   "max_num_seqs": args.max_running_requests, "gpu_memory_utilization": args.mem_fraction_static,
                   "max_model_len": args.context_length, "dtype": args.dtype or "auto",
                   "enable_prefix_caching": not args.no_prefix_caching, "kv_cache_gib": args.kv_cache_gib,
                   "seed": args.random_seed, "enable_sleep_mode": args.enable_memory_saver,
                   "pause_mode": args.pause_mode, "checkpoint_stream_interval": settings.checkpoint_tokens,
                   "extra_args": parse_key_values(args.vllm_arg, "--vllm-arg")}
    if args.weight_version is not None:
        options["weight_version"] = args.weight_version
    engine = create_engine(args.engine, **options)
    only = None
    if args.only_partitions:
        try:
            only = [int(x) for x in args.only_partitions.split(",") if x.strip()]
        except ValueError:
            raise SystemExit(f"redroll worker: --only-partitions {args.only_partitions!r} is not a list of "
                             "partition numbers (e.g. 0,2)") from None
    try:
        worker = Worker(settings, engine, max_inflight=args.max_inflight, name=args.name, only_partitions=only,
                        burst=args.burst)
    except ValueError as exc:
        raise SystemExit(f"redroll worker: {exc}") from None
    from redroll.observability.metrics import WorkerMetrics

    return await serve(worker, WorkerMetrics, args.metrics_port, settings)


def worker_refusal(args: argparse.Namespace) -> str | None:
    """Why ``redroll worker`` with these arguments must not start, or None: no engine named (no
    silent default: a worker without one would serve fake tokens), or a model directory that is not
    there (instead of a Hugging Face Hub error about repo ids)."""
    if args.engine is None:
        return f"name the engine with --engine or REDROLL_ENGINE: one of {', '.join(ENGINES)}"
    if args.engine not in ENGINES:
        return f"REDROLL_ENGINE={args.engine!r} is not an engine: one of {', '.join(ENGINES)}"
    path = args.model_path
    if args.engine == "synthetic" or os.path.isdir(path):
        return None
    if args.engine == "transformers" and (path == "tiny-random" or path.startswith("tiny-random:")):
        return None
    if args.engine in ("sglang", "vllm") and _HUB_REPO_ID.match(path):
        return None  # (SGLang and vLLM download a Hub repo id: ORG/NAME, not a path)
    return f"no such model directory: {path}"


_HUB_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""A Hugging Face Hub repo id, ``ORG/NAME`` (SGLang and vLLM take one for a model directory)."""
