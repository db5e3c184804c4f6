"""The ``redroll`` command line (argparse: no dependency, sub-commands, env defaults)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sys
from typing import Any, Sequence

import redis

from redroll.runtime import run as run_async_main
from redroll.shared.connection import RedisConfigError, connect, describe_error
from redroll.shared.lanes import LanesMismatchError
from redroll.shared.settings import Settings


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("connection (also REDROLL_* environment variables)")
    g.add_argument("--redis-url", default=argparse.SUPPRESS,
                   help="redis://, rediss:// or unix:// URL (env REDROLL_REDIS_URL)")
    g.add_argument("--namespace", default=argparse.SUPPRESS, help="pipeline namespace (env REDROLL_NAMESPACE)")
    g.add_argument("--partitions", type=int, default=argparse.SUPPRESS,
                   help="partitions of the pipeline, {ns:0}..{ns:P-1} (env REDROLL_PARTITIONS; default 1)")
    g.add_argument("--affinity-lanes", type=int, default=argparse.SUPPRESS, metavar="L",
                   help="affinity lanes per partition (env REDROLL_AFFINITY_LANES; default 0 = off); every "
                        "process of a pipeline must use the pipeline's L (see `redroll lanes`)")
    g.add_argument("--steal-after-ms", type=int, default=argparse.SUPPRESS, metavar="MS",
                   help="with affinity lanes: any worker takes an entry that waited this long in a lane "
                        "(env REDROLL_STEAL_AFTER_MS; default 1000)")
    g.add_argument("--cluster", dest="redis_cluster", action="store_const", const=True, default=argparse.SUPPRESS,
                   help="the URL names a node of a Redis Cluster (env REDROLL_REDIS_CLUSTER=1)")
    g.add_argument("--redis-username", default=argparse.SUPPRESS, help="ACL user (env REDROLL_REDIS_USERNAME)")
    g.add_argument("--redis-password-file", default=argparse.SUPPRESS,
                   help="file holding the password (env REDROLL_REDIS_PASSWORD_FILE; or REDROLL_REDIS_PASSWORD)")
    g.add_argument("--tls-ca-file", default=argparse.SUPPRESS,
                   help="with rediss://: the CA that signed the server's certificate (env REDROLL_TLS_CA_FILE; "
                        "default: the system's CAs)")
    g.add_argument("--tls-cert-file", default=argparse.SUPPRESS,
                   help="with rediss://: this client's certificate, for servers that require one "
                        "(env REDROLL_TLS_CERT_FILE)")
    g.add_argument("--tls-key-file", default=argparse.SUPPRESS,
                   help="with rediss://: the key of --tls-cert-file (env REDROLL_TLS_KEY_FILE)")
    g.add_argument("--log-level", default=argparse.SUPPRESS, choices=["debug", "info", "warning", "error"],
                   help="log level (env REDROLL_LOG_LEVEL; default info)")
    g.add_argument("--log-format", default=argparse.SUPPRESS, choices=["text", "json"],
                   help="log lines as text or one JSON object each (env REDROLL_LOG_FORMAT; default text)")


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{number} is not positive")
    return number


def _seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number of seconds") from None
    if value != value:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number of seconds")
    return value


def _positive_seconds(raw: str) -> float:
    value = _seconds(raw)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {raw}")
    return value


def _positive_gib(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number of GiB") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be more than 0 GiB, got {raw}")
    return value


def _seconds_from_zero(raw: str) -> float:
    value = _seconds(raw)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 seconds or more, got {raw}")
    return value


_DEFAULTS = Settings()
"""The settings' own defaults, as the help shows them."""

ENGINES = ["vllm", "sglang", "transformers", "synthetic"]
"""The engines ``redroll worker --engine`` runs (no default: a worker is told which)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="redroll", description="Queue-driven LLM generation on Redis Streams.")
    from redroll import __version__

    parser.add_argument("--version", action="version", version=f"redroll {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", help="run the whole pipeline once on the embedded default")
    _common(p)
    p.add_argument("--prompts", type=int, default=4, help="how many prompts the demo submits")
    p.add_argument("--engine", choices=["transformers", "synthetic"], default=None,
                   help="the demo's engine (default: transformers when torch is installed, else synthetic)")

    p = sub.add_parser("worker", help="run an engine worker")
    _common(p)
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
    g.add_argument("--kv-cache-gib", type=_positive_gib, default=None,
                   help="KV cache size in GiB (vllm: kv_cache_memory_bytes; on CPU default 1, or "
                        "VLLM_CPU_KVCACHE_SPACE when set)")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="turn vLLM's prefix cache off (on by default: affinity lanes exist to feed it)")
    g.add_argument("--vllm-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="any other vLLM AsyncEngineArgs argument (repeatable); VALUE is parsed as JSON when it can be")
    p.add_argument("--claim-idle-ms", type=int, default=None,
                   help="take over a request another worker has held this long without progress "
                        f"(env REDROLL_CLAIM_IDLE_MS; default {_DEFAULTS.claim_idle_ms})")
    p.add_argument("--max-deliveries", type=int, default=None,
                   help="dead-letter a request after this many deliveries "
                        f"(env REDROLL_MAX_DELIVERIES; default {_DEFAULTS.max_deliveries})")
    p.add_argument("--drain-timeout", type=float, default=None,
                   help=f"seconds to finish in-flight work on SIGTERM (env REDROLL_DRAIN_TIMEOUT_S; default "
                        f"{_DEFAULTS.drain_timeout_s:g})")
    p.add_argument("--name", default=None,
                   help="the worker's name, as status and drain show it (default: host-pid-random, unique per start)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")

    p = sub.add_parser("consume", help="apply callbacks to records through a consumer group")
    _common(p)
    p.add_argument("--group", required=True, help="the consumer group (each group sees every record once)")
    p.add_argument("--handler", action="append", default=[], metavar="NAME=module:function",
                   help="register a handler (repeatable); records select one by their callback name")
    p.add_argument("--default-handler", default=None, metavar="module:function",
                   help="handler for records that name no callback")
    p.add_argument("--stream", default=None, help="reply stream to consume (default {ns}:results)")
    p.add_argument("--claim-idle-ms", type=int, default=None,
                   help="take over a record another consumer of the group has held this long "
                        f"(env REDROLL_CLAIM_IDLE_MS; default {_DEFAULTS.claim_idle_ms})")
    p.add_argument("--max-deliveries", type=int, default=None,
                   help="dead-letter a record after this many deliveries "
                        f"(env REDROLL_MAX_DELIVERIES; default {_DEFAULTS.max_deliveries})")
    p.add_argument("--batch", type=int, default=128,
                   help="most records per read (fewer after large ones: see --batch-bytes)")
    p.add_argument("--batch-bytes", type=_positive_int, default=1 << 20,
                   help="record data per read and per applied chunk (default 1 MiB, at least one record): "
                        "async handlers run concurrently within a chunk")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")

    p = sub.add_parser("submit", help="submit requests from a JSONL file (one request per line)")
    _common(p)
    p.add_argument("file", help="JSONL file, or - for standard input")
    p.add_argument("--wait", action="store_true", help="wait for every record (through a private reply stream)")
    p.add_argument("--out", default=None, help="with --wait: write records here as JSONL (default stdout)")
    p.add_argument("--timeout", type=_positive_seconds, default=None, help="with --wait: give up after this many seconds")
    p.add_argument("--resume", action="store_true",
                   help="with --wait --out: take over the interrupted (or timed-out) run that wrote --out: its "
                        "requests with a record there are skipped, those still queued or in flight are taken over "
                        "(not run again), the rest submitted; records are appended")
    p.add_argument("--no-progress", action="store_true",
                   help="with --wait: no progress on stderr (a bar on a terminal; elsewhere a line every 10 s "
                        "and one at the end)")

    p = sub.add_parser("status", help="depth, pending, lag, workers, dead letters")
    _common(p)
    p.add_argument("--json", action="store_true", help="stable JSON for scripts")
    p.add_argument("--watch", action="store_true", help="refresh every --interval seconds")
    p.add_argument("--interval", type=_positive_seconds, default=2.0, help="seconds between --watch refreshes")

    p = sub.add_parser("exporter", help="serve the pipeline's Prometheus /metrics (backlog, workers, dead letters, "
                                        "weight versions, Redis memory), from Redis alone, as status reads it")
    _common(p)
    p.add_argument("--port", type=int, required=True, help="serve /metrics on this port (0 = any free port)")
    p.add_argument("--host", default="0.0.0.0", help="the address to bind")
    p.add_argument("--interval", type=_positive_seconds, default=5.0,
                   help="seconds between snapshots of the pipeline (each scrape reads the latest)")

    p = sub.add_parser("weights", help="broadcast a weight update, or release/resume engine memory")
    _common(p)
    p.add_argument("action", choices=["update", "release", "resume", "show"])
    p.add_argument("--model-path", default=None, help="update: the new weights (a path the workers can read)")
    p.add_argument("--version", default=None, help="update: the new weight_version")
    p.add_argument("--abort-inflight", action="store_true",
                   help="update: abort in-flight requests instead of letting them finish")
    p.add_argument("--in-place", action="store_true",
                   help="update: swap the weights under the requests in flight (between two decode steps; "
                        "their records carry per-token versions) instead of waiting for them")
    p.add_argument("--no-wait", action="store_true", help="update: do not wait for every live worker")
    p.add_argument("--timeout", type=_positive_seconds, default=600.0,
                   help="seconds to wait for the workers (release and resume: at most 120)")

    p = sub.add_parser("lanes", help="show or change the pipeline's affinity lanes (backlog and owner per lane)")
    _common(p)
    p.add_argument("action", choices=["show", "set"])
    p.add_argument("lanes", nargs="?", type=int, help="set: the new number of lanes (0 = off)")
    p.add_argument("--force", action="store_true",
                   help="set: change it even though lanes still hold entries (they stay there, unread, "
                        "until L is set back: see the README)")
    p.add_argument("--json", action="store_true", help="JSON for scripts")

    p = sub.add_parser("repair", help="give streams whose ids were exhausted (XADD with the largest id) their ids back")
    _common(p)
    p.add_argument("streams", nargs="*", help="stream keys to repair, e.g. '{redroll}:results'")
    p.add_argument("--all", action="store_true", help="every stream of the pipeline (requests, results, dead, "
                                                      "control, reply streams)")
    p.add_argument("--dry-run", action="store_true", help="only report which streams are broken")
    p.add_argument("--max-rebuild", type=int, default=None, metavar="N",
                   help="on servers that need the stream rebuilt (Valkey 8), copy at most N entries in the one "
                        "script (default 200000; the server is blocked meanwhile)")
    p.add_argument("--json", action="store_true", help="JSON for scripts")

    p = sub.add_parser("drain", help="ask workers to drain and exit (through the control stream)")
    _common(p)
    p.add_argument("workers", nargs="*", help="worker names (see redroll status)")
    p.add_argument("--all", action="store_true", help="every worker")

    p = sub.add_parser("dead", help="list, requeue or purge dead letters")
    _common(p)
    dsub = p.add_subparsers(dest="dead_command", required=True, metavar="ACTION")
    d = dsub.add_parser("list", help="dead letters, oldest first")
    _common(d)
    d.add_argument("--reason", default=None, help="only those whose reason contains this text")
    d.add_argument("--json", action="store_true", help="JSON for scripts (every field whole)")
    d.add_argument("--count", type=_positive_int, default=1000, help="at most this many per partition")
    d = dsub.add_parser("requeue", help="re-validate and requeue dead letters")
    _common(d)
    d.add_argument("ids", nargs="*", help="dead-letter entry ids (see dead list)")
    d.add_argument("--all", action="store_true", help="every dead letter")
    d.add_argument("--set", action="append", default=[], metavar="FIELD.PATH=JSON",
                   help="patch the request before requeueing, e.g. sampling_params.temperature=0.7")
    d = dsub.add_parser("purge", help="delete dead letters")
    _common(d)
    d.add_argument("ids", nargs="*", help="dead-letter entry ids (see dead list)")
    d.add_argument("--older-than", type=_seconds_from_zero, default=None, metavar="SECONDS",
                   help="every dead letter older than this")
    d.add_argument("--all", action="store_true", help="every dead letter")

    p = sub.add_parser("gc", help="remove reply streams of producers that never came back, gone workers' heartbeats")
    _common(p)
    p.add_argument("--dry-run", action="store_true", help="only report what would be removed")
    p.add_argument("--stale-worker-s", type=_seconds_from_zero, default=3600.0,
                   help="remove heartbeats of workers not seen for this many seconds")
    p.add_argument("--idle-consumer-s", type=_seconds_from_zero, default=3600.0,
                   help="remove consumers idle this many seconds that hold nothing")

    p = sub.add_parser("bench", help="the benchmark suite (from a source checkout): python -m benchmarks.bench",
                       add_help=False)
    p.add_argument("bench_args", nargs=argparse.REMAINDER)

    from redroll import trace_command
    trace_command.add_parser(sub, _common)

    p = sub.add_parser("abort", help="abort requests by request_id or group_id")
    _common(p)
    p.add_argument("request_ids", nargs="*", help="request ids to abort")
    p.add_argument("--group", action="append", default=[], help="abort every request of this group_id (repeatable)")
    for each in _parsers(parser):
        each.formatter_class = _HelpFormatter
    return parser


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default after its help, unless the help already says it or there is none to say."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (action.default in (None, False, [], argparse.SUPPRESS) or "default" in text
                or not action.option_strings):
            return text
        return super()._get_help_string(action)


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """``parser`` and every sub-command's parser, depth first."""
    out = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                out.extend(_parsers(child))
    return out


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


def _settings(args: argparse.Namespace, **extra: Any) -> Settings:
    keys = ("redis_url", "namespace", "partitions", "affinity_lanes", "steal_after_ms", "redis_cluster", "redis_username", "redis_password_file", "tls_ca_file", "tls_cert_file",
            "tls_key_file")
    overrides = {k: getattr(args, k) for k in keys if hasattr(args, k)}
    overrides.update({k: v for k, v in extra.items() if v is not None})
    return Settings.from_env(**overrides)


def _tune_gc() -> None:
    """Long-running processes: move start-up objects out of the collector's way and collect
    young objects less often (the hot paths allocate many short-lived, acyclic objects)."""
    import gc

    gc.freeze()
    gc.set_threshold(100_000, 50, 100)


def _install_signals(stop: Any, grace_s: float) -> Any:
    """First SIGTERM/SIGINT: graceful drain, bounded by ``grace_s`` (then exit: whatever was still
    held is reclaimed by the fleet after claim_idle). Second: exit at once. Returns a function that
    installs the same handlers again (an engine may have replaced them: SGLang does)."""
    loop = asyncio.get_running_loop()
    hits = {"n": 0}

    def give_up() -> None:
        print(f"shutdown took longer than {grace_s:.0f}s: exiting now", file=sys.stderr, flush=True)
        os._exit(1)

    def handler(signum: int) -> None:
        hits["n"] += 1
        if hits["n"] > 1:
            print("second signal: exiting now", file=sys.stderr)
            os._exit(128 + signum)
        loop.call_later(grace_s, give_up)
        stop()

    def install() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, handler, sig)

    install()
    return install


async def _serve(process: Any, metrics_class: Any, metrics_port: int | None, settings: Settings) -> int:
    """Run a long-lived worker or consumer: metrics if asked, signals, GC tuning, until stopped."""
    if metrics_port is not None:
        from redroll.shared.metrics import serve

        process.metrics = metrics_class(process)
        serve(process.metrics, metrics_port)
    install = _install_signals(process.request_stop, settings.drain_timeout_s + 10)
    _tune_gc()
    task = asyncio.create_task(process.run())
    started = getattr(process, "started", None)
    if started is not None:
        # SGLang's tokenizer manager puts its own SIGTERM handler on the loop when the engine starts
        # (tokenizer_manager.py:2453-2459): once started, redroll's drain takes SIGTERM back.
        waiter = asyncio.create_task(started.wait())
        await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        install()
    await task
    return 0


async def _run_worker(args: argparse.Namespace) -> int:
    from redroll.engine_worker.engines import create_engine
    from redroll.engine_worker.worker import Worker

    settings = _settings(args, claim_idle_ms=args.claim_idle_ms, max_deliveries=args.max_deliveries,
                         drain_timeout_s=args.drain_timeout)
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
        worker = Worker(settings, engine, max_inflight=args.max_inflight, name=args.name, only_partitions=only)
    except ValueError as exc:
        raise SystemExit(f"redroll worker: {exc}") from None
    from redroll.shared.metrics import WorkerMetrics

    return await _serve(worker, WorkerMetrics, args.metrics_port, settings)


async def _run_consume(args: argparse.Namespace) -> int:
    from redroll.consumer.handlers import load_handler, parse_handler_flag
    from redroll.consumer.runner import ConsumerRunner

    settings = _settings(args, claim_idle_ms=args.claim_idle_ms, max_deliveries=args.max_deliveries)
    if os.getcwd() not in sys.path and "" not in sys.path:  # handler modules of the current directory
        sys.path.insert(0, os.getcwd())                     # are found, as celery and rq find them
    handlers = dict(parse_handler_flag(h) for h in args.handler)
    default = load_handler(args.default_handler) if args.default_handler else None
    if not handlers and default is None:
        print("redroll consume: give at least one --handler NAME=module:function or --default-handler",
              file=sys.stderr)
        return 2
    runner = ConsumerRunner(settings, group=args.group, handlers=handlers, default_handler=default,
                            stream=args.stream, batch=args.batch, apply_bytes=args.batch_bytes)
    from redroll.shared.metrics import ConsumerMetrics

    return await _serve(runner, ConsumerMetrics, args.metrics_port, settings)


async def _run_status(args: argparse.Namespace) -> int:
    from redroll.status import collect_pipeline_status, render_status

    settings = _settings(args)
    async with connect(settings) as r:
        def snapshot() -> Any:
            return collect_pipeline_status(r, settings.keys, settings.partition_keys)

        if args.json and not args.watch:
            print(json.dumps(await snapshot(), indent=2, sort_keys=True))
            return 0
        if args.json:  # one JSON document a line, every interval, the first at once: nothing else on stdout
            while True:
                print(json.dumps(await snapshot(), sort_keys=True), flush=True)
                await asyncio.sleep(args.interval)
        from rich.console import Console
        from rich.live import Live

        if not args.watch:
            Console().print(render_status(await snapshot()))
            return 0
        if not sys.stdout.isatty():  # piped or redirected: plain frames, each flushed as it is printed
            console = Console()
            while True:
                console.print(render_status(await snapshot()))
                sys.stdout.flush()
                await asyncio.sleep(args.interval)
        with Live(render_status(await snapshot()), refresh_per_second=4) as live:
            while True:
                await asyncio.sleep(args.interval)
                live.update(render_status(await snapshot()))


async def _run_exporter(args: argparse.Namespace) -> int:
    from redroll.exporter import run_exporter

    settings = _settings(args)
    async with connect(settings) as r:
        await run_exporter(r, settings.keys, settings.partition_keys, args.port, args.interval, addr=args.host)
    return 0


async def _run_abort(args: argparse.Namespace) -> int:
    from redroll.shared.control import abort_requests

    if not args.request_ids and not args.group:
        print("redroll abort: name request ids or --group G", file=sys.stderr)
        return 2
    settings = _settings(args)
    async with connect(settings) as r:
        cancelled = await abort_requests(r, settings.keys, args.request_ids, group_ids=args.group,
                                         parts=settings.partition_keys, what="redroll abort")
    print(f"abort sent for {len(args.request_ids)} request(s) and {len(args.group)} group(s); "
          f"{len(cancelled)} cancelled while still queued")
    return 0


async def _run_weights(args: argparse.Namespace) -> int:
    from redroll.shared.commands import ReleaseMemory, ResumeMemory
    from redroll.shared.control import send_command, update_weights, wait_for_memory_command

    settings = _settings(args)
    async with connect(settings) as r:
        try:
            if args.action == "show":
                desired = {k.decode(): v.decode() for k, v in (await r.hgetall(settings.keys.weights)).items()}
                print(json.dumps(desired or None))
                return 0
            if args.action == "update":
                if not args.model_path or not args.version:
                    print("redroll weights update: --model-path and --version are required", file=sys.stderr)
                    return 2
                if args.in_place and args.abort_inflight:
                    print("redroll weights update: --in-place and --abort-inflight exclude each other",
                          file=sys.stderr)
                    return 2
                workers = await update_weights(r, settings.keys, args.model_path, args.version,
                                               abort_inflight=args.abort_inflight,
                                               mode="in_place" if args.in_place else None, wait=not args.no_wait,
                                               timeout=args.timeout)
                print(f"weights {args.version} ({args.model_path}) " +
                      ("broadcast" if args.no_wait else f"running on {len(workers)} live worker(s)"))
                return 0
            kind = "release_memory" if args.action == "release" else "resume_memory"
            sent = await send_command(r, settings.keys, ReleaseMemory() if args.action == "release" else ResumeMemory())
            if args.no_wait:
                print(f"{kind} broadcast")
                return 0
            want = "released" if args.action == "release" else "running"
            done, failed = await wait_for_memory_command(r, settings.keys, kind, sent, want,
                                                         timeout=min(args.timeout, 120.0))
            for worker, error in sorted(failed.items()):
                print(f"redroll weights {args.action}: worker {worker} refused: {error}", file=sys.stderr)
            print(f"{kind}: {len(done)} worker(s) {want}" + (f", {len(failed)} refused" if failed else ""))
            return 1 if failed else 0
        except TimeoutError as exc:
            print(f"redroll weights: {exc}", file=sys.stderr)
            return 1


def dead_table(entries: Sequence[Any], title: str, width: int) -> Any:
    """``redroll dead list`` as a table of one line a row that fits ``width`` columns: the reason,
    then the request_id, are cut short with an ellipsis (``--json`` has them whole)."""
    from rich import box
    from rich.table import Table

    rows = [(e.id, e.request_id or "-", e.source, str(e.deliveries), f"{e.age_s:.0f}", e.reason) for e in entries]
    heads = ("id", "request_id", "source", "tries", "age s")
    fits = [max([len(head), *(len(row[i]) for row in rows)]) for i, head in enumerate(heads)]
    fits[1] = min(fits[1], 32)
    between = 3 * len(heads)  # (a space each side of a column and a rule between two)
    spare = width - sum(fits) - between
    if spare < 30:  # the request_id gives way first, down to 12 characters
        fits[1] = max(min(fits[1], 12), fits[1] - (30 - spare))
        spare = width - sum(fits) - between
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, title_justify="left")
    for head, fit in zip(heads, fits):
        table.add_column(head, no_wrap=True, overflow="ellipsis", min_width=fit, max_width=fit)
    reason = max(8, spare)
    table.add_column("reason", no_wrap=True, overflow="ellipsis", min_width=min(reason, 8), max_width=reason)
    for row in rows:
        table.add_row(*row)
    return table


async def _run_dead(args: argparse.Namespace) -> int:
    from redroll import dead

    settings = _settings(args)
    async with connect(settings) as r:
        if args.dead_command == "list":
            entries = [e for part in settings.partition_keys
                       for e in await dead.list_dead(r, part, reason=args.reason, count=args.count)]
            if args.json:
                print(json.dumps([e.to_json() for e in entries], indent=2))
                return 0
            from rich.console import Console

            console = Console()
            console.print(dead_table(entries, f"dead letters in {settings.keys.dead} ({len(entries)})", console.width))
            return 0
        if args.dead_command == "requeue":
            if not args.ids and not args.all:
                print("redroll dead requeue: name entry ids or --all", file=sys.stderr)
                return 2
            done, refused = await dead.requeue(r, settings, None if args.all else args.ids,
                                               patches=dead.parse_patches(args.set))
            for msg in refused:
                print(f"refused {msg}", file=sys.stderr)
            print(f"requeued {len(done)} dead letter(s)")
            return 0 if not refused else 3
        if not args.ids and args.older_than is None and not args.all:
            print("redroll dead purge: name entry ids, --older-than SECONDS or --all", file=sys.stderr)
            return 2
        n = 0
        for part in settings.partition_keys:
            n += await dead.purge(r, part, args.ids or None, older_than_s=args.older_than)
        print(f"purged {n} dead letter(s)")
        return 0


async def _run_gc(args: argparse.Namespace) -> int:
    from redroll.shared.gc import collect_garbage

    settings = _settings(args)
    async with connect(settings) as r:
        report = await collect_garbage(r, settings.keys, reply_ttl_s=settings.reply_ttl_s,
                                       partitions=settings.partition_keys,
                                       stale_worker_s=args.stale_worker_s, idle_consumer_s=args.idle_consumer_s,
                                       dry_run=args.dry_run)
    print(json.dumps({"dry_run": args.dry_run, "removed": report.to_json()}, indent=2))
    return 0


async def _run_lanes(args: argparse.Namespace) -> int:
    from redroll.shared.lanes import lane_report, set_lanes

    settings = _settings(args)
    async with connect(settings) as r:
        if args.action == "set":
            if args.lanes is None:
                print("redroll lanes set: give the number of lanes, e.g. `redroll lanes set 8`", file=sys.stderr)
                return 2
            try:
                before = await set_lanes(r, settings.keys, settings.with_(affinity_lanes=0).partition_keys,
                                         args.lanes, force=args.force)
            except ValueError as exc:
                print(f"redroll lanes set: {exc}", file=sys.stderr)
                return 1
            print(f"affinity_lanes: {before} -> {args.lanes}; restart producers and workers with "
                  f"REDROLL_AFFINITY_LANES={args.lanes} (processes with another value refuse to start)")
            return 0
        report = await lane_report(r, settings.keys, settings.with_(affinity_lanes=0).partition_keys)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    if not report["lanes"]:
        print(f"affinity lanes are off for {settings.namespace} (set with `redroll lanes set N`)")
        return 0
    print(f"affinity_lanes={report['lanes']}; queued in lanes: {report['backlog']}")
    for lane in report["per_lane"]:
        print(f"  {lane['stream']}: backlog {lane['backlog']}, in flight {lane['pending']}, "
              f"owner {lane['owner'] or '-'}")
    return 0


async def _run_repair(args: argparse.Namespace) -> int:
    from redroll.repair import MAX_REBUILD_ENTRIES, pipeline_streams, repair_stream

    if not args.streams and not args.all:
        print("redroll repair: name stream keys or --all", file=sys.stderr)
        return 2
    settings = _settings(args)
    async with connect(settings) as r:
        keys = args.streams or await pipeline_streams(r, settings.keys, settings.partition_keys)
        limit = args.max_rebuild if args.max_rebuild is not None else MAX_REBUILD_ENTRIES
        reports = [await repair_stream(r, key, dry_run=args.dry_run, max_rebuild=limit) for key in keys]
    if args.json:
        print(json.dumps([x.to_json() for x in reports], indent=2))
    for rep in reports:
        if args.json or rep.state in ("ok", "none"):
            continue
        if rep.state == "repaired":
            print(f"{rep.key}: repaired: last id {rep.last_id} -> {rep.new_last_id}; removed {len(rep.removed)} "
                  f"entr{'y' if len(rep.removed) == 1 else 'ies'} from the future"
                  + (f"; groups moved back: {', '.join(rep.groups_reset)}" if rep.groups_reset else "")
                  + ("; the stream was rebuilt (same entries, groups and pending entries)"
                     if rep.method == "rebuilt" else ""))
        elif rep.state == "toolarge":
            print(f"{rep.key}: ids exhausted and this server needs the stream rebuilt, {rep.length} entries: "
                  f"more than --max-rebuild {limit}; nothing changed (raise it, accepting that the server "
                  "blocks about a second per 100k entries)")
        elif rep.state == "broken":
            print(f"{rep.key}: ids exhausted (last id {rep.last_id}): run without --dry-run to repair")
        else:
            print(f"{rep.key}: a {rep.kind}, not a stream: remove or rename it by hand (redroll recreates the stream)")
    broken = [x for x in reports if x.state in ("broken", "wrongtype", "toolarge")]
    if not args.json:
        print(f"checked {len(reports)} stream(s): {sum(x.state == 'repaired' for x in reports)} repaired, "
              f"{len(broken)} still broken")
    return 1 if broken else 0


async def _run_drain(args: argparse.Namespace) -> int:
    from redroll.shared.commands import Drain
    from redroll.shared.control import send_command

    if not args.workers and not args.all:
        print("redroll drain: name workers or --all", file=sys.stderr)
        return 2
    from redroll.shared.control import live_workers

    settings = _settings(args)
    async with connect(settings) as r:
        if not args.all:
            live = await live_workers(r, settings.keys)
            unknown = [name for name in args.workers if name not in live]
            if unknown:  # (a typo, or a worker already gone: nothing would ever read the command)
                print(f"redroll drain: no live worker named {', '.join(unknown)}; nothing sent (live workers: "
                      f"{', '.join(sorted(live)) or 'none'})", file=sys.stderr)
                return 1
        for target in (["*"] if args.all else args.workers):
            await send_command(r, settings.keys, Drain(target=None if target == "*" else target))
    print("drain sent to " + ("every worker" if args.all else ", ".join(args.workers)))
    return 0


def _benchmark_checkout() -> str | None:
    """The source checkout that holds ``benchmarks/`` (the suite is not installed with redroll):
    the current directory, or the checkout an editable install points at."""
    from pathlib import Path

    here = Path(__file__).resolve().parent.parent
    for root in (Path.cwd(), here):
        if (root / "benchmarks" / "bench.py").is_file():
            return str(root)
    return None


def _run_bench(argv: list[str]) -> int:
    """``redroll bench ARGS`` runs ``python -m benchmarks.bench ARGS`` in the source checkout (as its
    own process: redroll never imports the benchmarks)."""
    import subprocess

    root = _benchmark_checkout()
    if root is None:
        print("redroll bench: needs a source checkout (benchmarks/ is not installed); from a clone run "
              "python -m benchmarks.bench", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, "-m", "benchmarks.bench", *argv], cwd=root)


def _worker_refusal(args: argparse.Namespace) -> str | None:
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


def _trace_run(args: argparse.Namespace) -> Any:
    from redroll import trace_command
    return trace_command.run(args, _settings(args))


def main(argv: Sequence[str] | None = None) -> int:
    from redroll.logs import setup_logging

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # everything after it belongs to the benchmark suite's own parser
        return _run_bench(argv[1:])
    args = build_parser().parse_args(argv)
    setup_logging(getattr(args, "log_level", os.environ.get("REDROLL_LOG_LEVEL", "info")),
                  getattr(args, "log_format", os.environ.get("REDROLL_LOG_FORMAT", "text")))
    try:
        settings_for_errors = Settings.from_env(redis_url=getattr(args, "redis_url", None))
    except ValueError as exc:  # (a REDROLL_* variable that is not a valid value)
        print(f"redroll {args.command}: {exc}", file=sys.stderr)
        return 2
    if args.command == "worker" and (refusal := _worker_refusal(args)):
        print(f"redroll worker: {refusal}", file=sys.stderr)
        return 2
    try:
        if args.command == "demo":
            from redroll.demo import main_demo

            ns = getattr(args, "namespace", None) or os.environ.get("REDROLL_NAMESPACE") or "redroll-demo"
            return main_demo(ns, args.prompts, args.engine, getattr(args, "redis_url", None))
        if args.command == "submit":
            from redroll.resume import ResumeError
            from redroll.submit import InputError, submit_file

            if not args.wait and (args.out is not None or args.timeout is not None):
                print("redroll submit: --out and --timeout need --wait (without it the records go to the "
                      "results stream, for consumer groups)", file=sys.stderr)
                return 2
            if args.resume and (not args.wait or args.out is None):
                print("redroll submit: --resume needs --wait and --out (it continues the run that wrote --out)",
                      file=sys.stderr)
                return 2
            try:
                return run_async_main(submit_file(_settings(args), args.file, wait=args.wait, out=args.out,
                                               progress=not args.no_progress, timeout=args.timeout,
                                               resume=args.resume))
            except (InputError, ResumeError) as exc:
                print(f"redroll submit: {exc}", file=sys.stderr)
                return 2
        runner = {"worker": _run_worker, "consume": _run_consume, "status": _run_status, "exporter": _run_exporter,
                  "abort": _run_abort,
                  "weights": _run_weights, "drain": _run_drain, "repair": _run_repair, "lanes": _run_lanes,
                  "dead": _run_dead, "gc": _run_gc, "trace": _trace_run}
        return run_async_main(runner[args.command](args))
    except KeyboardInterrupt:
        return 130
    except (redis.RedisError, RedisConfigError) as exc:
        print(f"redroll {args.command}: {describe_error(exc, settings_for_errors)}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"redroll {args.command}: {exc}", file=sys.stderr)
        return 1
    except (ValueError, ImportError) as exc:
        print(f"redroll {args.command}: {exc}", file=sys.stderr)
        return 2
    except LanesMismatchError as exc:
        print(f"redroll {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
