"""The worker alone, draining requests queued beforehand: its CPU per request, redis-server's, its rate.

    python -m benchmarks.worker_drain [--requests 60000] [--runs 4] [--json-out FILE]

In the ceiling section four processes share two cores, so the worker's own cost per request is
mixed with everyone else's. Here the requests are queued first (the ceiling's producer process), then one
worker as the ceiling runs it (``redroll worker --engine synthetic --token-ms 0 --max-inflight
256``) drains them with nothing else running; the figures are taken from its first record to the
last ``--tail`` (its start and its drain at exit are left out). (What compiling the worker's hot
path with Cython bought, measured with an earlier version of this module, is in
docs/performance.md, "A compiled hot path, measured".)
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import BenchError, Procs, Server, emit_json, redroll_env, wait_for
from benchmarks.runs import NAMESPACE, producer_argv, redroll_worker_argv
from redroll.shared.keys import Keys


def drain(server: Server, run_dir: Path, n: int, tail: int, general_path: bool = False) -> dict[str, float]:
    """Queue ``n`` requests (the ceiling's producer process, 500 a call), then let one worker drain
    them alone (``general_path``: a task per request, as for an engine that takes time)."""
    server.fresh()
    env = redroll_env(server, NAMESPACE)
    results, measured = Keys(NAMESPACE).results, n - tail
    with Procs(run_dir) as procs:
        producer = procs.spawn("producer", producer_argv(n, run_dir / "producer.json"), env)
        if producer.popen.wait() != 0:
            raise BenchError(f"the producer exited with code {producer.popen.returncode}:\n{producer.tail()}")
    with Procs(run_dir) as procs:
        argv = redroll_worker_argv(token_ms=0, max_inflight=256) + (["--no-instant-path"] if general_path else [])
        worker = procs.spawn("worker", argv, env)
        wait_for(lambda: server.r.xlen(results) > 0, 60, "the worker's first record", procs=procs, interval=0.001)
        t0, w0, r0 = time.perf_counter(), worker.sample_cpu(), server.cpu_s()
        wait_for(lambda: server.r.xlen(results) >= tail + measured, 120, "the drain", procs=procs, interval=0.001)
        t1, w1, r1 = time.perf_counter(), worker.sample_cpu(), server.cpu_s()
    return {"rate": round(measured / (t1 - t0), 1), "worker_us": round((w1 - w0) * 1e6 / measured, 2),
            "redis_us": round((r1 - r0) * 1e6 / measured, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=60_000)
    ap.add_argument("--tail", type=int, default=1_000, help="records at the end left out of the figures")
    ap.add_argument("--runs", type=int, default=4, help="drains measured (the medians are printed)")
    ap.add_argument("--json-out")
    ap.add_argument("--paths", choices=["instant", "both"], default="instant",
                    help="both: each run drains twice, through the instant path and through the general one "
                         "(a task per request), side by side: what the instant path buys")
    a = ap.parse_args(argv)
    if not 0 < a.tail < a.requests:
        ap.error("--tail must be between 0 and --requests")
    base = Path(tempfile.mkdtemp(prefix="redroll-drain-"))
    server = Server()
    try:
        runs: list[dict[str, float]] = []
        general: list[dict[str, float]] = []
        for k in range(a.runs):
            for path, into in (("instant", runs), ("general", general)):
                if path == "general" and a.paths != "both":
                    continue
                run_dir = base / f"drain-{k}-{path}"
                run_dir.mkdir()
                run = drain(server, run_dir, a.requests, a.tail, general_path=path == "general")
                into.append(run)
                print(f"{path:8} {run['rate']:9.0f} req/s  worker {run['worker_us']:6.2f} µs  "
                      f"redis-server {run['redis_us']:6.2f} µs a request", file=sys.stderr, flush=True)
        out = {"requests": a.requests, "tail": a.tail, "runs": runs,
               "medians": {key: statistics.median(r[key] for r in runs) for key in runs[0]}}
        if general:
            out["general_path"] = {"runs": general,
                                   "medians": {key: statistics.median(r[key] for r in general) for key in general[0]}}
        emit_json(out, a.json_out)
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
