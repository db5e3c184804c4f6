"""Section 5, ``peers``: the same three-hop flow on taskiq-redis, arq, Celery and BullMQ, side by side.

Each peer runs in a virtualenv of its own under the cache directory (``$REDROLL_BENCH_CACHE`` or
``~/.cache/redroll-bench``), created and installed on first use from ``requirements-peers.txt``
(taskiq-redis, Celery), ``requirements-arq.txt`` (arq: redis-py < 6) and ``requirements-bullmq.txt``
(BullMQ's Python port); a peer whose install fails is skipped with the reason. Nothing is installed
into redroll's own environment.

Flow per peer, one process per role, same host, same redis-server (emptied before each run):
producer process → job worker process (makes the 8-token result) → callback worker process
(counts; the last callback writes the done file). redroll runs through the same function as a
peer, as its users run it (``benchmarks/peers/peer_redroll.py``): a producer script of its own
(``asyncio.run``, the public ``make_request`` and ``send``, 100 requests a ``send`` as the peers'
producers hand over 100 jobs at a time, ``peers.common.CHUNK``), ``redroll worker --engine
synthetic --max-inflight 256`` and ``redroll consume``; the suite's own ceiling run with 500 a send
(its producer tool, ``benchmarks/proc_producer.py``) is shown beside it, not compared. Each run is
timed from the producer's first enqueue to the last callback, and also from starting the
producer's process (``benchmarks/outside.py`` times both, with none of the suite's machinery: the
yardstick this section is held to).

The whole comparison repeats ``cfg.peer_runs`` times (``--peer-runs``; 5, or 1 with ``--quick``),
every peer and redroll once a round, interleaved so that load drift hits them all. The figures are
medians over the rounds; ``redroll_vs_best_peer_min`` is the worst round's redroll / fastest peer.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import ROOT, BenchError, Procs, Server, new_run_dir, read_json, wait_for
from benchmarks.peers.common import CHUNK
from benchmarks.results import SectionResult
from benchmarks.runs import queue_run

HERE = Path(__file__).resolve().parent


def cache_dir() -> Path:
    return Path(os.environ.get("REDROLL_BENCH_CACHE") or Path.home() / ".cache" / "redroll-bench")


class PeerUnavailable(RuntimeError):
    pass


def ensure_venv(name: str, requirements: Path, check_import: str, log: list[str]) -> Path:
    """A virtualenv with ``requirements`` installed; reinstalled when the file changes."""
    venv = cache_dir() / name
    py = venv / "bin" / "python"
    stamp = venv / ".requirements.sha256"
    want = hashlib.sha256(requirements.read_bytes()).hexdigest()
    if py.exists() and stamp.exists() and stamp.read_text().strip() == want:
        ok = subprocess.run([str(py), "-c", f"import {check_import}"], capture_output=True)
        if ok.returncode == 0:
            return py
    log.append(f"installing {requirements.name} into {venv} (first run; takes a minute)")
    print(f"  peers: installing {requirements.name} into {venv} ...", file=sys.stderr, flush=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, capture_output=True,
                       timeout=300)
        subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-r",
                        str(requirements)], check=True, capture_output=True, timeout=900)
        subprocess.run([str(py), "-c", f"import {check_import}"], check=True, capture_output=True, timeout=120)
    except subprocess.CalledProcessError as exc:
        tail = (exc.stderr or b"").decode(errors="replace").strip().splitlines()[-6:]
        raise PeerUnavailable(f"could not install {requirements.name} into {venv}: " + " | ".join(tail)) from None
    except (subprocess.TimeoutExpired, OSError) as exc:
        raise PeerUnavailable(f"could not install {requirements.name} into {venv}: {exc}") from None
    stamp.write_text(want)
    return py


def _versions(py: Path, dists: list[str]) -> dict[str, str]:
    code = ("import importlib.metadata as m, json; print(json.dumps({d: m.version(d) for d in %r}))" % dists)
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True)
    try:
        import json

        return json.loads(out.stdout)
    except ValueError:
        return {}


def _peer_argv(peer: str, py: Path, role: str, count: int, out: Path) -> list[str]:
    bindir = py.parent
    if peer == "taskiq":
        if role == "producer":
            return [str(py), "-m", "benchmarks.peers.peer_taskiq", "--count", str(count), "--out", str(out)]
        broker = "job_broker" if role == "worker" else "result_broker"
        return [str(bindir / "taskiq"), "worker", f"benchmarks.peers.peer_taskiq:{broker}", "--workers", "1",
                "--max-async-tasks", "256", "--no-configure-logging", "--log-level", "WARNING"]
    if peer == "celery":
        if role == "producer":
            return [str(py), "-m", "benchmarks.peers.peer_celery", "--count", str(count), "--out", str(out)]
        queue = "jobs" if role == "worker" else "results"
        return [str(py), "-m", "celery", "-A", "benchmarks.peers.peer_celery", "worker", "-Q", queue, "-P", "solo",
                "-c", "1", "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "WARNING",
                "-n", f"{queue}@bench"]
    if peer == "arq":
        if role == "producer":
            return [str(py), "-m", "benchmarks.peers.peer_arq", "--count", str(count), "--out", str(out)]
        cls = "JobWorker" if role == "worker" else "ResultWorker"
        return [str(bindir / "arq"), f"benchmarks.peers.peer_arq.{cls}"]
    if peer == "bullmq":
        return [str(py), "-m", "benchmarks.peers.peer_bullmq", role, "--count", str(count), "--out", str(out)]
    if peer == "redroll":
        from benchmarks.peers import peer_redroll

        if role == "producer":
            return [str(py), "-m", "benchmarks.peers.peer_redroll", "--count", str(count), "--out", str(out)]
        return peer_redroll.worker_argv(str(py)) if role == "worker" else peer_redroll.consumer_argv(str(py))
    raise ValueError(peer)


def _ready(peer: str, server: Server, run_dir: Path) -> bool:
    """Whether the worker and the consumer are ready: a peer's scripts say so in files; redroll's
    worker has its heartbeat and its consumer its group, what a user waits for."""
    if peer != "redroll":
        return (run_dir / "worker.ready").exists() and (run_dir / "consumer.ready").exists()
    try:
        groups = server.r.xinfo_groups("{redroll}:results")
    except Exception:
        return False
    return server.r.hlen("{redroll}:workers") >= 1 and any(g["name"] in (b"bench", "bench") for g in groups)


def run_peer(server: Server, base: Path, peer: str, py: Path, count: int) -> dict[str, Any]:
    server.fresh()
    run_dir = new_run_dir(base, f"peer-{peer}")
    done, prod = run_dir / "consumer.json", run_dir / "producer.json"
    env = {"BENCH_REDIS_URL": server.url, "BENCH_EXPECT": str(count), "BENCH_DONE_FILE": str(done),
           "BENCH_READY_DIR": str(run_dir), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
           "REDROLL_REDIS_URL": server.url, "REDROLL_LOG_LEVEL": "warning"}
    if peer != "redroll":  # (redroll runs in the suite's own environment)
        env.update(VIRTUAL_ENV=str(py.parent.parent), PATH=f"{py.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    with Procs(run_dir) as procs:
        for role in ("worker", "consumer"):
            procs.spawn(role, _peer_argv(peer, py, role, count, prod), env)
        wait_for(lambda: _ready(peer, server, run_dir), 90, f"{peer} workers to start", procs=procs)
        time.sleep(0.3)
        cpu0 = procs.sample_cpu()
        r0 = server.cpu_s()
        t_spawn = time.time()
        procs.spawn("producer", _peer_argv(peer, py, "producer", count, prod), env)
        try:
            wait_for(lambda: done.exists(), max(120, count / 20), f"{count} {peer} callbacks", procs=procs,
                     allow_exited=("producer",), interval=0.05)
        except BenchError as exc:
            raise BenchError(f"{exc}\n" + "\n".join(f"--- {p.name}\n{p.tail(10)}" for p in procs.items)) from None
        cpu1 = procs.sample_cpu()
        r1 = server.cpu_s()
        wait_for(lambda: prod.exists(), 60, f"the {peer} producer's report", procs=procs, allow_exited=("producer",))
    p, c = read_json(prod), read_json(done)
    elapsed = c["t_last"] - p["t_first"]
    cpu = {k: round((cpu1[k] - cpu0.get(k, 0.0)) * 1e6 / count, 1) for k in cpu1 if k != "producer"}
    cpu["producer"] = round(p["cpu_s"] * 1e6 / count, 1)
    cpu["redis-server"] = round((r1 - r0) * 1e6 / count, 1)
    return {"rate": count / elapsed, "elapsed_s": round(elapsed, 3), "jobs": count,
            "rate_from_producer_start": count / (c["t_last"] - t_spawn),
            "producer_start_s": round(p["t_first"] - t_spawn, 3),
            "producer_submit_s": round(p["t_last"] - p["t_first"], 3), "job_fields_as_json_bytes": p.get("job_bytes"),
            "cpu_us_per_job": cpu}


PEERS = {
    "taskiq": ("peers-venv", "requirements-peers.txt", "taskiq_redis", ["taskiq", "taskiq-redis", "redis"]),
    "celery": ("peers-venv", "requirements-peers.txt", "celery", ["celery", "kombu", "redis"]),
    "arq": ("arq-venv", "requirements-arq.txt", "arq", ["arq", "redis"]),
    "bullmq": ("bullmq-venv", "requirements-bullmq.txt", "bullmq", ["bullmq", "redis"]),
}


def compare(rounds: list[dict[str, float]]) -> dict[str, Any]:
    """Rates per round (``{"redroll": r, peer: r, ...}``, the same names each round) -> the figures.

    Medians, minima and maxima per name; the best peer by median; and per round redroll's rate over
    that round's fastest peer (their minimum is the figure held to the target, their median shown).
    """
    names = list(rounds[0])
    peers = [p for p in names if p != "redroll"]
    out: dict[str, Any] = {
        "median": {k: statistics.median(r[k] for r in rounds) for k in names},
        "min": {k: min(r[k] for r in rounds) for k in names},
        "max": {k: max(r[k] for r in rounds) for k in names},
    }
    if peers:
        fastest = [max(peers, key=r.__getitem__) for r in rounds]
        ratios = [r["redroll"] / r[p] for r, p in zip(rounds, fastest)]
        out.update(best_peer=max(peers, key=out["median"].__getitem__), fastest_per_round=fastest,
                   ratio_per_round=ratios, ratio_min=min(ratios), ratio_median=statistics.median(ratios))
    return out


def _spread(c: dict[str, Any], name: str, rounds: int) -> str:
    if rounds == 1:
        return "1 run"
    return f"median of {rounds} runs; min {c['min'][name]:,.0f}, max {c['max'][name]:,.0f}"


def peers(server: Server, cfg: Any, base: Path, res: SectionResult) -> None:
    n = cfg.peer_jobs
    rounds = cfg.peer_runs  # set by bench.py's --peer-runs
    log: list[str] = []
    skipped: dict[str, str] = {}
    pys: dict[str, Path] = {}
    for peer, (venv, reqs, mod, dists) in PEERS.items():
        try:
            pys[peer] = ensure_venv(venv, HERE / reqs, mod, log)
        except PeerUnavailable as exc:
            skipped[peer] = str(exc)
            print(f"  peers: skipping {peer}: {exc}", file=sys.stderr, flush=True)
            continue
        res.details[peer] = {"versions": _versions(pys[peer], dists), "runs": []}
    res.details["redroll"] = {"requests": n, "per_send": CHUNK, "runs": [], "how": "benchmarks/peers/peer_redroll.py"}
    res.details["redroll_500"] = {"requests": n, "per_send": 500, "runs": []}
    per_round: list[dict[str, float]] = []
    from_start: list[dict[str, float]] = []
    for k in range(1, rounds + 1):
        rates: dict[str, float] = {}
        started: dict[str, float] = {}
        for peer, py in [*pys.items(), ("redroll", Path(sys.executable))]:
            try:
                out = run_peer(server, base, peer, py, n)
            except BenchError as exc:  # out of the comparison, every round: the peers compared stay the same
                if peer == "redroll":
                    raise
                skipped[peer] = f"run {k} failed: {exc}"
                print(f"  peers: {peer} failed in run {k}: {exc}", file=sys.stderr, flush=True)
                del pys[peer]
                continue
            res.details[peer]["runs"].append(out)
            rates[peer] = out["rate"]
            started[peer] = out["rate_from_producer_start"]
        # (shown beside it, not compared) the ceiling section's run: its producer tool, 500 a send
        run = queue_run(server, new_run_dir(base, f"peer-redroll_500-{k}"), n, chunk=500)
        res.details["redroll_500"]["runs"].append({"rate": run.rate, "elapsed_s": round(run.elapsed, 3),
                                                   "cpu_us_per_request": run.cpu_us_per_item()})
        rates["redroll_500"] = run.rate
        per_round.append(rates)
        from_start.append(started)
        print(f"  peers: run {k}/{rounds}: " + ", ".join(f"{p} {r:,.0f}/s" for p, r in rates.items()),
              file=sys.stderr, flush=True)
    compared = [*pys, "redroll"]  # the peers that completed every round
    c = compare([{p: r[p] for p in compared} for r in per_round])
    rates_500 = [r["redroll_500"] for r in per_round]
    res.details["runs"] = rounds
    res.details["rates_per_run"] = per_round
    for peer in pys:
        res.fig(f"{peer}_rps", c["median"][peer], "jobs/s", note=_spread(c, peer, rounds))
    res.fig("redroll_rps", c["median"]["redroll"], "req/s",
            note=f"{n} requests, same flow as the peers, {CHUNK} a send; {_spread(c, 'redroll', rounds)}")
    res.fig("redroll_500_rps", statistics.median(rates_500), "req/s",
            note=f"the same with 500 requests a send (the ceiling section's), not compared; "
                 f"min {min(rates_500):,.0f}, max {max(rates_500):,.0f}")
    if pys:
        best = c["best_peer"]
        res.fig("best_peer_rps", c["median"][best], "jobs/s", note=f"{best} (the fastest peer by median)")
        worst = c["ratio_per_round"].index(c["ratio_min"])
        res.fig("redroll_vs_best_peer_min", c["ratio_min"], "x", target=">= 10", check=lambda v: v >= 10,
                note=f"worst run ({worst + 1} of {rounds}), vs its fastest peer {c['fastest_per_round'][worst]}")
        res.fig("redroll_vs_best_peer_median", c["ratio_median"], "x",
                note="median over the runs of redroll / that run's fastest peer")
        res.details.update(best_peer=best, fastest_peer_per_run=c["fastest_per_round"],
                           redroll_vs_best_peer_per_run=[round(x, 3) for x in c["ratio_per_round"]])
        c_start = compare([{p: r[p] for p in compared} for r in from_start])
        res.fig("redroll_vs_best_peer_from_producer_start", c_start["ratio_median"], "x",
                note="the same runs timed from starting the producer's process (interpreter start and imports "
                     "included: what `time python producer.py` sees)")
        ceiling = (res.details.get("_context") or {}).get("ceiling_rps")
        if ceiling:  # the ceiling section's figure from this same invocation (more requests)
            res.details["ceiling_redroll_rps_vs_best_peer"] = round(ceiling / c["median"][best], 3)
    if skipped:
        res.details["skipped"] = skipped
        if not pys:
            res.skipped = "; ".join(f"{k}: {v[:200]}" for k, v in skipped.items())
    if log:
        res.details["install_log"] = log
    res.details["how"] = (
        "one process per role on the suite's redis-server: producer -> job worker (makes the 8-token "
        "result like the synthetic engine) -> callback worker (counts; done file at the last one). "
        "taskiq: RedisStreamBroker for jobs and for callbacks (the job kicks on_result), `taskiq worker "
        "--workers 1 --max-async-tasks 256`, groups from id 0, xread_count 256; Celery: Redis broker, "
        "job.apply_async(link=on_result.s()) routed to queues jobs/results, `-P solo`, prefetch 64, "
        "no result backend; arq: the job enqueues on_result on a second queue, max_jobs 256, poll_delay "
        "10 ms, keep_result 0; BullMQ (Python port): Queue.addBulk 100 a call, Worker concurrency 100 "
        "returning the result, removeOnComplete, the collector a QueueEvents listener on 'completed' "
        "(reads each event's JSON returnvalue) from id 0, events stream capped at 100,000 (default "
        "10,000). redroll as its users run it (benchmarks/peers/peer_redroll.py): a producer script "
        "(asyncio.run, make_request and send from the same job dicts), `redroll worker --engine synthetic "
        "--max-inflight 256`, `redroll consume` with the same counting callback. Jobs are JSON (arq: "
        "pickle) of the same fields as a redroll request. Each run runs every peer then redroll; figures "
        "are medians over the runs, the ratios per run vs that run's fastest peer, timed from the "
        "producer's first enqueue (and, redroll_vs_best_peer_from_producer_start, from starting its "
        "process). Every producer hands over 100 jobs at a time (peers.common.CHUNK): a gather of 100 "
        "enqueues (taskiq, arq), one addBulk (BullMQ), one send (redroll); Celery's apply_async sends one at a "
        "time. redroll with 500 a send (the ceiling section's producer tool) is shown beside it, not compared.")
