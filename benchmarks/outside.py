"""An outside-style peers run: what a user comparing queues would measure, with none of the suite's machinery.

    python -m benchmarks.outside [--jobs 3000] [--runs 5] [--only redroll,bullmq,...] [--json-out FILE]

For redroll and each peer (BullMQ's Python port, taskiq-redis, arq, Celery): a plain
``redis-server`` started here (no persistence, loopback), emptied before each run; the system's
worker and consumer started as its users start them (``benchmarks/peers/``: redroll's are
``redroll worker --engine synthetic --max-inflight 256`` and ``redroll consume``, each peer's its
own CLI or script, every one with its throughput setting: BullMQ concurrency 100, taskiq and arq
256, Celery's prefetch 64); once both say they are ready, the producer script (``--jobs`` jobs,
100 at a time) is started. Each run is timed two ways: from the producer's first enqueue to the
last callback (the clock every peer's scripts keep, the suite's too), and from starting the
producer's process (interpreter start and imports included) to the last callback. Every system
runs once a round, the order turning each round, ``--runs`` rounds; the figures are medians and
ranges over the rounds, and redroll over the fastest peer.

This does not import the suite's harness (``benchmarks.harness``, ``benchmarks.runs``): no
byte-compiling of the checkout, no process groups, no shared helpers beyond the peers' own
scripts and the virtualenvs the suite installs them into (``~/.cache/redroll-bench``; see
``benchmarks/peers_section.py``). It is the yardstick the suite's ``peers`` section is held to.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("redroll", "bullmq", "taskiq", "arq", "celery")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(directory: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(directory)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def python_for(system: str) -> str:
    """redroll runs in this interpreter (the checkout's environment); a peer in its virtualenv."""
    if system == "redroll":
        return sys.executable
    from benchmarks.peers_section import HERE, PEERS, PeerUnavailable, ensure_venv

    venv, reqs, module, _dists = PEERS[system]
    try:
        return str(ensure_venv(venv, HERE / reqs, module, []))
    except PeerUnavailable as exc:
        raise SystemExit(f"outside: {system} is not installed: {exc}") from None


def argv_for(system: str, py: str, role: str, jobs: int, out: Path) -> list[str]:
    from benchmarks.peers import peer_redroll
    from benchmarks.peers_section import _peer_argv

    if system == "redroll":
        if role == "producer":
            return [py, "-m", "benchmarks.peers.peer_redroll", "--count", str(jobs), "--out", str(out)]
        return peer_redroll.worker_argv(py) if role == "worker" else peer_redroll.consumer_argv(py)
    return _peer_argv(system, Path(py), role, jobs, out)


def wait(predicate: Any, timeout: float, what: str, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: a process exited with {p.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.02)


def ready(system: str, client: redis.Redis, run_dir: Path) -> bool:
    if system == "redroll":  # (a user waits for the worker's heartbeat and the consumer group)
        try:
            groups = client.xinfo_groups("{redroll}:results")
        except redis.ResponseError:
            return False
        return client.hlen("{redroll}:workers") >= 1 and any(g["name"] == b"bench" for g in groups)
    return (run_dir / "worker.ready").exists() and (run_dir / "consumer.ready").exists()


def one_run(system: str, py: str, url: str, jobs: int, base: Path) -> dict[str, float]:
    client = redis.Redis.from_url(url)
    client.flushall()
    run_dir = Path(tempfile.mkdtemp(prefix=f"{system}-", dir=base))
    done, prod = run_dir / "consumer.json", run_dir / "producer.json"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("REDROLL_")},
           "REDROLL_REDIS_URL": url, "REDROLL_LOG_LEVEL": "warning", "BENCH_REDIS_URL": url,
           "BENCH_EXPECT": str(jobs), "BENCH_DONE_FILE": str(done), "BENCH_READY_DIR": str(run_dir),
           "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    if system != "redroll":
        env.update(VIRTUAL_ENV=str(Path(py).parent.parent), PATH=f"{Path(py).parent}{os.pathsep}{env.get('PATH', '')}")
    procs: list[subprocess.Popen] = []
    try:
        for role in ("worker", "consumer"):
            log = open(run_dir / f"{role}.log", "wb")
            procs.append(subprocess.Popen(argv_for(system, py, role, jobs, prod), env=env, cwd=ROOT, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        wait(lambda: ready(system, client, run_dir), 120, f"{system}'s worker and consumer", procs)
        time.sleep(0.3)
        t_spawn = time.time()
        with open(run_dir / "producer.log", "wb") as log:
            producer = subprocess.Popen(argv_for(system, py, "producer", jobs, prod), env=env, cwd=ROOT, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        wait(done.exists, max(120, jobs / 20), f"{jobs} {system} callbacks", procs)
        if producer.wait(60) != 0:
            raise RuntimeError(f"{system}'s producer exited with {producer.returncode}")
        p, c = json.loads(prod.read_text()), json.loads(done.read_text())
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        client.close()
    return {"from_first_enqueue": jobs / (c["t_last"] - p["t_first"]), "from_producer_start": jobs / (c["t_last"] - t_spawn),
            "elapsed_s": round(c["t_last"] - p["t_first"], 3), "producer_start_s": round(p["t_first"] - t_spawn, 3)}


def summarize(rounds: list[dict[str, dict[str, float]]], clock: str) -> dict[str, Any]:
    names = list(rounds[0])
    peers = [n for n in names if n != "redroll"]
    out: dict[str, Any] = {n: {"median": round(statistics.median(r[n][clock] for r in rounds), 1),
                               "min": round(min(r[n][clock] for r in rounds), 1),
                               "max": round(max(r[n][clock] for r in rounds), 1)} for n in names}
    if peers and "redroll" in names:
        best = max(peers, key=lambda n: out[n]["median"])
        per_round = [r["redroll"][clock] / max(r[p][clock] for p in peers) for r in rounds]
        out["best_peer"] = best
        out["redroll_vs_best_peer_median"] = round(out["redroll"]["median"] / out[best]["median"], 2)
        out["redroll_vs_fastest_peer_per_round"] = [round(x, 2) for x in per_round]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.outside", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=3000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--only", default=",".join(SYSTEMS), help="systems to run, among " + ",".join(SYSTEMS))
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args(argv)
    systems = [s.strip() for s in a.only.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        ap.error(f"unknown system(s) {', '.join(unknown)}")
    pys = {s: python_for(s) for s in systems}
    base = Path(tempfile.mkdtemp(prefix="redroll-outside-"))
    server, url = start_redis(base)
    rounds: list[dict[str, dict[str, float]]] = []
    load = [round(x, 2) for x in os.getloadavg()]
    try:
        for k in range(a.runs):
            order = systems[k % len(systems):] + systems[:k % len(systems)]
            rates = {s: one_run(s, pys[s], url, a.jobs, base) for s in order}
            rounds.append({s: rates[s] for s in systems})
            print(f"  outside: run {k + 1}/{a.runs}: " + ", ".join(f"{s} {rates[s]['from_first_enqueue']:,.0f}/s"
                                                                   for s in systems), file=sys.stderr, flush=True)
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(base, ignore_errors=True)
    doc = {"suite": "redroll-outside", "jobs": a.jobs, "runs": a.runs, "loadavg_at_start": load,
           "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
           "from_first_enqueue": summarize(rounds, "from_first_enqueue"),
           "from_producer_start": summarize(rounds, "from_producer_start"),
           "rounds": rounds}
    text = json.dumps(doc, indent=2)
    print(text)
    if a.json_out:
        Path(a.json_out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
