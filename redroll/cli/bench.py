"""``redroll bench``: the benchmark suite of a source checkout (``python -m benchmarks.bench``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="the benchmark suite (from a source checkout): python -m benchmarks.bench",
                       add_help=False)
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(run=lambda args: run(args.bench_args))


def benchmark_checkout() -> str | None:
    """The source checkout that holds ``benchmarks/`` (the suite is not installed with redroll):
    the current directory, or the checkout an editable install points at."""
    from pathlib import Path

    here = Path(__file__).resolve().parents[2]
    for root in (Path.cwd(), here):
        if (root / "benchmarks" / "bench.py").is_file():
            return str(root)
    return None


def run(argv: list[str]) -> int:
    """``redroll bench ARGS`` runs ``python -m benchmarks.bench ARGS`` in the source checkout (as its
    own process: redroll never imports the benchmarks)."""
    import subprocess

    root = benchmark_checkout()
    if root is None:
        print("redroll bench: needs a source checkout (benchmarks/ is not installed); from a clone run "
              "python -m benchmarks.bench", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, "-m", "benchmarks.bench", *argv], cwd=root)
