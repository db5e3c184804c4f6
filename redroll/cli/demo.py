"""``redroll demo``: the whole pipeline once, on the embedded default."""

from __future__ import annotations

import argparse
import os
from typing import Any

from redroll.cli.options import add_connection_options


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="run the whole pipeline once on the embedded default")
    add_connection_options(p)
    p.add_argument("--prompts", type=int, default=4, help="how many prompts the demo submits")
    p.add_argument("--engine", choices=["transformers", "synthetic"], default=None,
                   help="the demo's engine (default: transformers when torch is installed, else synthetic)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from redroll.cli.demo_run import main_demo

    ns = getattr(args, "namespace", None) or os.environ.get("REDROLL_NAMESPACE") or "redroll-demo"
    return main_demo(ns, args.prompts, args.engine, getattr(args, "redis_url", None))
