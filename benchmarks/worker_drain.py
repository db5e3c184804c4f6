"""The worker alone, draining requests queued beforehand: its CPU per request, redis-server's, its rate.

    python -m benchmarks.worker_drain [--requests 60000] [--pairs 4] [--compiled] [--json-out FILE]

In the ceiling section four processes share two cores, so the worker's own cost per request is
mixed with everyone else's. Here the requests are queued first (the ceiling's producer process), then one
worker as the ceiling runs it (``redroll worker --engine synthetic --token-ms 0 --max-inflight
256``) drains them with nothing else running; the figures are taken from its first record to the
last ``--tail`` (its start and its drain at exit are left out).

``--compiled`` measures what compiling the worker's hot path buys instead of assuming it: the
modules in :data:`HOT_MODULES` are built with Cython (its pure-Python mode: annotations are not
made C types, so the code's meaning is unchanged) into a copy of the package, and runs of that
copy alternate with runs of the interpreted one, ``--pairs`` of each (the machine's speed drifts
within seconds: compare pairs, not single runs). Needs Cython (``pip install cython``) and a C
compiler with Python's headers.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import ROOT, BenchError, Procs, Server, emit_json, redroll_env, wait_for
from benchmarks.runs import NAMESPACE, producer_argv, redroll_worker_argv
from redroll.shared.keys import Keys

HOT_MODULES = (
    "redroll.engine_worker.worker", "redroll.engine_worker.claim", "redroll.engine_worker.flights",
    "redroll.engine_worker.request", "redroll.engine_worker.records", "redroll.engine_worker.outcomes",
    "redroll.engine_worker.publisher", "redroll.engine_worker.engines.synthetic", "redroll.shared.codec",
    "redroll.shared.streams", "redroll.shared.batcher", "redroll.shared.scripts", "redroll.shared.connection",
)
"""Every redroll module of the worker's per-request path (see the worker's profile in
docs/performance.md)."""

PACKAGES = ("redroll", "redroll.commands", "redroll.shared", "redroll.producer", "redroll.engine_worker",
            "redroll.engine_worker.engines", "redroll.consumer")

_BUILD = """
import sys
from Cython.Build import cythonize
from setuptools import Extension, setup
modules = sys.argv.pop(1).split(",")
extensions = [Extension(m, [m.replace(".", "/") + ".py"]) for m in modules]
setup(name="redroll-compiled", script_args=sys.argv[1:], ext_modules=cythonize(
    extensions, quiet=True, compiler_directives={"language_level": 3, "annotation_typing": False, "binding": True}))
"""


def package_tree(dest: Path) -> Path:
    """A copy of the installed redroll packages under ``dest`` in the installed layout
    (``dest/redroll/shared/…``): put first on ``PYTHONPATH``, it is the redroll a process imports."""
    for name in PACKAGES:
        source = Path(importlib.import_module(name).__path__[0])
        target = dest.joinpath(*name.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for item in source.iterdir():  # (subpackages are copied as packages of their own)
            if item.is_file() and item.suffix == ".py":
                shutil.copy2(item, target / item.name)
            elif item.is_dir() and item.name == "lua":
                shutil.copytree(item, target / "lua", dirs_exist_ok=True)
    return dest


def build_compiled(dest: Path, modules: tuple[str, ...] = HOT_MODULES) -> Path:
    """:func:`package_tree` with ``modules`` built as extension modules beside their sources
    (an extension module is imported ahead of a ``.py`` file of the same name)."""
    try:
        import Cython  # noqa: F401
    except ImportError:
        raise BenchError("--compiled needs Cython: pip install cython") from None
    package_tree(dest)
    log = dest / "build.log"
    with open(log, "wb") as fh:
        done = subprocess.run([sys.executable, "-c", _BUILD, ",".join(modules), "build_ext", "--inplace",
                               "-j", str(os.cpu_count() or 1), "--build-temp", str(dest / "build")],
                              cwd=dest, stdout=fh, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise BenchError(f"building the compiled modules failed:\n{log.read_text(errors='replace')[-3000:]}")
    loaded = imported_files(dest, modules)
    if len(loaded) != len(modules) or not all(path.endswith(".so") for path in loaded):
        raise BenchError(f"the compiled modules are not the ones imported: {loaded}")
    return dest


def imported_files(tree: Path, modules: tuple[str, ...]) -> list[str]:
    """The files ``modules`` come from in a process started in ``tree`` as :func:`drain` starts
    its worker there."""
    code = f"import importlib; print(*(importlib.import_module(m).__file__ for m in {list(modules)!r}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tree)})
    if done.returncode != 0:
        raise BenchError(f"importing redroll from {tree} failed:\n{done.stderr[-2000:]}")
    return done.stdout.split()


def drain(server: Server, run_dir: Path, n: int, tail: int, python_path: Path | None = None) -> dict[str, float]:
    """Queue ``n`` requests (the ceiling's producer process, 500 a call), then let one worker drain
    them alone (``python_path``: a package tree its process imports redroll from)."""
    server.fresh()
    env = redroll_env(server, NAMESPACE)
    results, measured = Keys(NAMESPACE).results, n - tail
    with Procs(run_dir) as procs:
        producer = procs.spawn("producer", producer_argv(n, run_dir / "producer.json"), env)
        if producer.popen.wait() != 0:
            raise BenchError(f"the producer exited with code {producer.popen.returncode}:\n{producer.tail()}")
    cwd = ROOT
    if python_path is not None:  # (``python -m`` puts its folder ahead of PYTHONPATH: start it there)
        env["PYTHONPATH"] = f"{python_path}{os.pathsep}{env['PYTHONPATH']}"
        cwd = python_path
    with Procs(run_dir) as procs:
        worker = procs.spawn("worker", redroll_worker_argv(token_ms=0, max_inflight=256), env, cwd=cwd)
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
    ap.add_argument("--pairs", type=int, default=4, help="runs of each variant (alternated with --compiled)")
    ap.add_argument("--compiled", action="store_true", help="alternate with the hot path built by Cython")
    ap.add_argument("--json-out")
    a = ap.parse_args(argv)
    if not 0 < a.tail < a.requests:
        ap.error("--tail must be between 0 and --requests")
    base = Path(tempfile.mkdtemp(prefix="redroll-drain-"))
    server = Server()
    try:
        compiled = build_compiled(base / "compiled") if a.compiled else None
        runs: dict[str, list[dict[str, float]]] = {"interpreted": []} | ({"compiled": []} if compiled else {})
        for k in range(a.pairs):
            for variant in runs:
                run_dir = base / f"{variant}-{k}"
                run_dir.mkdir()
                run = drain(server, run_dir, a.requests, a.tail, compiled if variant == "compiled" else None)
                runs[variant].append(run)
                print(f"{variant:11s} {run['rate']:9.0f} req/s  worker {run['worker_us']:6.2f} µs  "
                      f"redis-server {run['redis_us']:6.2f} µs a request", file=sys.stderr, flush=True)
        out: dict[str, Any] = {"requests": a.requests, "tail": a.tail, "runs": runs, "medians": {
            variant: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for variant, rs in runs.items()}}
        if compiled:
            out["compiled_modules"] = list(HOT_MODULES)
            out["worker_us_compiled_over_interpreted"] = [
                round(c["worker_us"] / i["worker_us"], 4) for i, c in zip(runs["interpreted"], runs["compiled"])]
        emit_json(out, a.json_out)
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
