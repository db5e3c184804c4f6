"""``redroll capacity``: how many GPUs one Redis primary carries for a workload (:mod:`redroll.ops.capacity`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from redroll.cli.options import positive_int


def _positive(value: str) -> float:
    number = float(value)
    if number <= 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return number


def add_parser(sub: Any) -> argparse.ArgumentParser:
    from redroll.ops.capacity import CONSTANTS, Workload

    defaults = Workload(tokens_per_s=1, completion_tokens=1)
    p = sub.add_parser("capacity", help="how many GPUs one Redis primary carries for a workload, and what "
                                        "Cluster shards add (the model and its measured inputs)",
                       description="Prints the derivation: requests, chunks and checkpoints per GPU each second, "
                                   "the Redis CPU each costs (constants measured by the project's benchmarks; "
                                   "--show-constants says where each came from), the GPUs one primary carries, "
                                   "and a Redis Cluster's.")
    p.add_argument("--tokens-per-s", type=_positive, required=True, help="output tokens per second per GPU")
    p.add_argument("--completion-tokens", type=_positive, required=True, help="tokens per completion")
    p.add_argument("--concurrency", type=positive_int, default=defaults.concurrency,
                   help="requests decoding at once per GPU (each stream's speed: its chunk size)")
    p.add_argument("--stream", action="store_true", help="completions are streamed (Producer.stream, the gateway)")
    p.add_argument("--no-continuation", dest="continuation", action="store_false",
                   help="the workers run with continuation off: only streamed requests save their output")
    p.add_argument("--workers-per-gpu", type=_positive, default=defaults.workers_per_gpu,
                   help="worker processes per GPU (a tensor-parallel engine over 8 GPUs: 0.125)")
    p.add_argument("--stream-chunk-tokens", type=positive_int, default=defaults.stream_chunk_tokens,
                   help="the workers' setting: a chunk at most every this many tokens")
    p.add_argument("--stream-chunk-ms", type=float, default=defaults.stream_chunk_ms, metavar="MS",
                   help="the workers' setting: a chunk at least every this many ms with a new token")
    p.add_argument("--checkpoint-tokens", type=positive_int, default=defaults.checkpoint_tokens,
                   help="the workers' setting: a checkpoint every this many new tokens ...")
    p.add_argument("--checkpoint-interval-s", type=float, default=defaults.checkpoint_interval_s, metavar="SECONDS",
                   help="... and this many seconds, whichever comes later")
    p.add_argument("--checkpoint-min-new-tokens", type=int, default=defaults.checkpoint_min_new_tokens,
                   help="the workers' setting: requests of fewer new tokens are not checkpointed")
    p.add_argument("--share-of-core", type=float, default=0.8,
                   help="how busy the primary's core may be (0-1; Redis runs commands on one core)")
    p.add_argument("--gpus", type=positive_int, default=None, help="your fleet's size: how many shards it needs")
    for name, constant in CONSTANTS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=None,
                       help=f"{constant.unit} (measured: {constant.value:g})")
    p.add_argument("--show-constants", action="store_true", help="also print where each constant came from")
    p.add_argument("--json", action="store_true", help="the estimate as JSON")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from redroll.ops.capacity import CONSTANTS, Workload, estimate, render

    workload = Workload(tokens_per_s=args.tokens_per_s, completion_tokens=args.completion_tokens,
                        concurrency=args.concurrency, stream=args.stream, continuation=args.continuation,
                        workers_per_gpu=args.workers_per_gpu, stream_chunk_tokens=args.stream_chunk_tokens,
                        stream_chunk_ms=args.stream_chunk_ms, checkpoint_tokens=args.checkpoint_tokens,
                        checkpoint_interval_s=args.checkpoint_interval_s,
                        checkpoint_min_new_tokens=args.checkpoint_min_new_tokens)
    overrides = {name: getattr(args, name) for name in CONSTANTS}
    e = estimate(workload, share_of_core=args.share_of_core, **overrides)
    if args.json:
        sys.stdout.write(json.dumps(e.to_json(), indent=2) + "\n")
        return 0
    print(render(e, args.gpus))
    if args.show_constants:
        print("\nconstants:")
        for name, constant in CONSTANTS.items():
            given = " (given)" if overrides[name] is not None else ""
            print(f"  {name} = {e.constants[name]:g}{given}: {constant.unit}\n    from: {constant.source}")
    return 0
