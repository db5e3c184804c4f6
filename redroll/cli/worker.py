"""``redroll worker``: run an engine worker (its flags, the checks before it starts, the run)."""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

from redroll.cli.burst import add_burst_flag
from redroll.cli.engine_flags import add_engine_flags, engine_options, flag_refusal
from redroll.cli.options import (
    SETTING_DEFAULTS,
    add_connection_options,
    add_delivery_flags,
    add_metrics_flags,
    non_negative_int,
    positive_int,
    settings_from_args,
    usage_error,
)
from redroll.cli.process import serve
from redroll.engine_worker.engines.registry import ENGINES, engine_spec
from redroll.shared.settings import RECOVERY_SPLITS, Settings


def add_parser(sub: Any) -> None:
    p = sub.add_parser("worker", help="run an engine worker", description=_description())
    add_connection_options(p)
    p.add_argument("--engine", default=os.environ.get("REDROLL_ENGINE") or None, metavar="ENGINE",
                   help=f"the engine to run (env REDROLL_ENGINE; required): {', '.join(ENGINES)}, or "
                        "package.module:Class for an engine of your own")
    p.add_argument("--model-path", default=os.environ.get("REDROLL_MODEL_PATH") or None,
                   help="the model the engine serves: a local directory, a Hugging Face Hub id (vllm, sglang), "
                        "or tiny-random (transformers: the built-in tiny model); env REDROLL_MODEL_PATH; "
                        "required by the engines that load a model")
    p.add_argument("--max-inflight", type=positive_int, default=_env_int("REDROLL_MAX_INFLIGHT"),
                   help="requests the worker holds at once (env REDROLL_MAX_INFLIGHT; default: the engine's "
                        "capacity, --max-running-requests or its own, plus --claim-prefetch; 32 for an engine "
                        "without one)")
    p.add_argument("--only-partitions", default=os.environ.get("REDROLL_ONLY_PARTITIONS"),
                   help="claim only from these partitions, e.g. 0,2 (env REDROLL_ONLY_PARTITIONS; default: all)")
    add_engine_flags(p)
    add_delivery_flags(p, "request", "another worker")
    p.add_argument("--claim-prefetch", type=non_negative_int, default=None, metavar="N",
                   help="claim what the engine can start now plus N more, so a freed slot is refilled without "
                        "waiting for a claim (env REDROLL_CLAIM_PREFETCH; default "
                        f"{SETTING_DEFAULTS.claim_prefetch}; as large as --max-inflight: claim up to it at once)")
    p.add_argument("--recovery-split", choices=RECOVERY_SPLITS, default=None,
                   help="how the entries of a worker that died are taken back: halving runs them in ever "
                        "smaller groups until a request that kills workers is alone, alone runs each one by "
                        f"itself (env REDROLL_RECOVERY_SPLIT; default {SETTING_DEFAULTS.recovery_split})")
    p.add_argument("--notice", type=_seconds, default=None, metavar="S",
                   help="seconds the worker has once told to stop (SIGTERM, redroll drain): what will finish within "
                        "them finishes here, the rest is saved and handed back to the fleet at once (env "
                        f"REDROLL_NOTICE_S; default {SETTING_DEFAULTS.notice_s:g}, which fits Kubernetes' default "
                        "30 s grace period with room for the save; set it a few seconds below your platform's notice)")
    p.add_argument("--drain-timeout", type=float, default=None,
                   help="the older bound on a stop: the worker takes the smaller of this and --notice (env "
                        f"REDROLL_DRAIN_TIMEOUT_S; default {SETTING_DEFAULTS.drain_timeout_s:g})")
    p.add_argument("--name", default=None,
                   help="the worker's name, as status and drain show it (default: host-pid-random, unique per start)")
    add_metrics_flags(p)
    add_burst_flag(p, "worker")
    p.set_defaults(run=run)


async def run(args: argparse.Namespace) -> int:
    if refusal := worker_refusal(args):
        return usage_error("worker", f"{refusal}")
    return await run_worker(args)


def worker_settings(args: argparse.Namespace) -> Settings:
    """The worker's settings: defaults, then ``REDROLL_*`` variables, then its flags."""
    return settings_from_args(args, claim_idle_ms=args.claim_idle_ms, max_deliveries=args.max_deliveries,
                              drain_timeout_s=args.drain_timeout, notice_s=args.notice,
                              claim_prefetch=args.claim_prefetch,
                              recovery_split=args.recovery_split)


async def run_worker(args: argparse.Namespace) -> int:
    from redroll.engine_worker.worker import Worker

    settings = worker_settings(args)
    spec = engine_spec(args.engine)
    engine = spec.create(**engine_options(args, spec, settings))
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

    return await serve(worker, WorkerMetrics, args.metrics_port, settings, args.metrics_host)


def worker_refusal(args: argparse.Namespace) -> str | None:
    """Why ``redroll worker`` with these arguments must not start, or None: no engine named (no
    silent default: a worker without one would serve fake tokens), an engine flag the engine does
    not honour, no model for an engine that loads one, or a model directory that is not there
    (instead of a Hugging Face Hub error about repo ids)."""
    if args.engine is None:
        return f"name the engine with --engine or REDROLL_ENGINE: one of {', '.join(ENGINES)}"
    try:
        spec = engine_spec(args.engine)
    except ValueError as exc:
        return f"{exc} (--engine or REDROLL_ENGINE)"
    if refusal := flag_refusal(args, spec):
        return refusal
    path = args.model_path
    if not spec.loads_model:
        return None
    if path is None:
        return (f"the {spec.name} engine needs --model-path (or REDROLL_MODEL_PATH): a local model directory"
                + (" or a Hub id ORG/NAME" if spec.accepts_hub_ids else "")
                + (f", or {' or '.join(spec.builtin_models)}" if spec.builtin_models else ""))
    if os.path.isdir(path) or any(path == m or path.startswith(m + ":") for m in spec.builtin_models):
        return None
    if spec.accepts_hub_ids and _HUB_REPO_ID.match(path):
        return None  # (the engine downloads a Hub repo id: ORG/NAME, not a path)
    return f"no such model directory: {path}"


def _description() -> str:
    return "Run an engine worker. Engines:\n" + "\n".join(
        f"  {spec.name:13} {spec.summary}" for spec in ENGINES.values())


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not seconds >= 0:
        raise argparse.ArgumentTypeError(f"{value} is less than 0")
    return seconds


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    return int(raw) if raw else None


_HUB_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""A Hugging Face Hub repo id, ``ORG/NAME`` (SGLang and vLLM take one for a model directory)."""
