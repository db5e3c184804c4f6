"""Fleet scale: what a thousand workers cost one redis-server, registering, at idle, and at the ceiling.

    python -m benchmarks.fleet [--workers 1024] [--ceiling-workers 256] [--processes 8] [--idle-s 20]
                               [--requests 20000] [--runs 3]

Also the bench's ``fleet`` section (``python -m benchmarks.bench --only fleet --workers 1024``).
The workers are full ``Worker`` instances on the synthetic engine (0 ms per token), spread over
``--processes`` host processes (``benchmarks/proc_fleet.py``), with the default block, claim-idle
and heartbeat settings; each has its own name and connections, so Redis sees ``--workers`` workers.

- start: from starting the host processes to every worker's heartbeat in ``{ns}:workers``
  (registered), and, with lanes, to every lane owned by exactly one worker's beat (settled).
- idle: the fleet registered and settled, no requests: redis-server CPU over ``--idle-s`` as a
  share of one core, and the commands per second behind it; affinity lanes off, then on
  (L = 4 x workers, the setting the affinity bench found best).
- ceiling: ``--requests`` requests (producer process, ``send``) through ``--ceiling-workers``
  workers to one consumer process, against the same run with 4 workers: the ratio says what the
  fleet's size costs.

Redis needs a connection per worker loop (about 7 a worker) and a file descriptor per connection:
the section raises the server's ``maxclients`` to what the fleet needs, and says the file-descriptor
limit it ran under (``ulimit -n``; redis-server cannot take more clients than its limit less 32).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import redis

from benchmarks.harness import BenchError, Procs, Server, new_run_dir, redroll_env, wait_for
from benchmarks.results import SectionResult
from benchmarks.runs import NAMESPACE, PY, pipeline_run, producer_argv

WORKERS_KEY = "{" + NAMESPACE + "}:workers"
CONNECTIONS_PER_WORKER = 8
"""What the section provisions per worker in ``maxclients`` (a worker opens about 7)."""


def provision(server: Server, workers: int) -> dict[str, Any]:
    """Raise the server's ``maxclients`` to what ``workers`` workers need (the benchmark owns the
    server), within what its file-descriptor limit allows; say what the limits are."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = workers * CONNECTIONS_PER_WORKER + 256
    current = int(server.r.config_get("maxclients")["maxclients"])
    if current < need:
        try:
            server.r.config_set("maxclients", need)
        except redis.ResponseError as exc:  # ("try with N": the server's own limit)
            raise BenchError(f"redis-server cannot take {need} clients for {workers} workers: {exc} (raise "
                             "`ulimit -n` for the benchmark, which redis-server inherits)") from None
    return {"ulimit_n_soft": soft, "ulimit_n_hard": hard,
            "maxclients": int(server.r.config_get("maxclients")["maxclients"]), "maxclients_needed": need}


def lanes_settled(server: Server, lanes: int) -> bool:
    """Every lane owned by exactly one worker, by what the workers' beats say they own."""
    owned = [j for raw in server.r.hvals(WORKERS_KEY) for j in (json.loads(raw).get("lanes") or [])]
    return len(owned) == lanes and len(set(owned)) == lanes


def host_argvs(workers: int, processes: int) -> list[list[str]]:
    """``processes`` host processes with ``workers`` workers between them (as even as it goes)."""
    processes = max(1, min(processes, workers))
    counts = [workers // processes + (1 if i < workers % processes else 0) for i in range(processes)]
    return [[PY, "-m", "benchmarks.proc_fleet", "--workers", str(c)] for c in counts]


def idle(server: Server, run_dir: Path, workers: int, processes: int, seconds: float, lanes: int) -> dict[str, Any]:
    server.fresh()
    limits = provision(server, workers)
    env = redroll_env(server, NAMESPACE, REDROLL_AFFINITY_LANES=lanes)
    with Procs(run_dir) as procs:
        t0 = time.monotonic()
        for i, argv in enumerate(host_argvs(workers, processes)):
            procs.spawn(f"host{i}", argv, env)
        wait_for(lambda: server.r.hlen(WORKERS_KEY) >= workers, 300, f"{workers} workers to register", procs=procs,
                 interval=0.1)
        registered_s = time.monotonic() - t0
        settled_s = registered_s
        if lanes:
            wait_for(lambda: lanes_settled(server, lanes), 300, f"{lanes} lanes to be owned once each", procs=procs,
                     interval=0.5)
            settled_s = time.monotonic() - t0
        time.sleep(min(5.0, seconds / 2))  # past start-up (the last claims, the first reclaim passes)
        server.r.config_resetstat()
        c0, r0, t0 = procs.sample_cpu(), server.cpu_s(), time.monotonic()
        time.sleep(seconds)
        c1, r1, t1 = procs.sample_cpu(), server.cpu_s(), time.monotonic()
        stats = server.r.info("commandstats")
        clients = int(server.r.info("clients")["connected_clients"])
        procs.check_alive()
        registered = server.r.hlen(WORKERS_KEY)
    elapsed = t1 - t0
    shown = [(name.removeprefix("cmdstat_"), st) for name, st in sorted(stats.items(), key=lambda kv: -kv[1]["usec"])
             if st["calls"] and not name.startswith(("cmdstat_config", "cmdstat_info"))]
    per_s = {name: round(st["calls"] / elapsed, 1) for name, st in shown}
    # (a script's time includes the commands it runs, which are listed too)
    busy = {name: round(st["usec"] / elapsed / 1e4, 3) for name, st in shown}
    return {"workers": workers, "registered": registered, "affinity_lanes": lanes, "seconds": round(elapsed, 1),
            "registered_s": round(registered_s, 1), "settled_s": round(settled_s, 1), "connected_clients": clients,
            **limits,
            "redis_cpu_share_of_one_core": round((r1 - r0) / elapsed, 4), "commands_per_s": per_s,
            "command_time_pct_of_one_core": busy,
            "hosts_cores_busy": round(sum(c1[k] - c0.get(k, 0.0) for k in c1) / elapsed, 3),
            "commands_per_s_total": round(sum(per_s.values()), 1)}


def ceiling(server: Server, run_dir: Path, workers: int, processes: int, requests: int) -> dict[str, Any]:
    def all_registered() -> dict:
        wait_for(lambda: server.r.hlen(WORKERS_KEY) >= workers, 300, f"{workers} workers to register")
        # (a worker registers at the end of its start-up; a host's hundreds of workers then open their
        # loops and first reclaim passes: the run would share the cores with that, which is not the
        # fleet's ceiling)
        time.sleep(min(3.0, workers / 64))
        return {}

    provision(server, workers)
    run = pipeline_run(server, run_dir, count=requests, workers=host_argvs(workers, processes),
                       producer=producer_argv(requests, run_dir / "producer.json", chunk=500),
                       on_ready=all_registered, timeout=max(120, requests / 50))
    return {"workers": workers, "requests": requests, "rps": round(run.rate, 1), "elapsed_s": round(run.elapsed, 3),
            "cpu_us_per_request": run.cpu_us_per_item()}


def fleet(server: Server, cfg: Any, base: Path, res: SectionResult) -> None:
    w, procs, big = cfg.fleet_workers, cfg.fleet_processes, cfg.fleet_ceiling_workers or cfg.fleet_workers
    for lanes in (0, 4 * w):
        out = idle(server, new_run_dir(base, f"fleet-idle-l{lanes}"), w, procs, cfg.fleet_idle_s, lanes)
        label = "lanes_on" if lanes else "lanes_off"
        res.details[f"idle_{label}"] = out
        res.fig(f"registered_{w}w_{label}_s", out["registered_s"], "s", target="<= 60", check=lambda v: v <= 60,
                note=f"from starting {procs} host processes to every heartbeat"
                     + (f"; every lane owned once at {out['settled_s']:g} s" if lanes else ""))
        target, limit = ("< 10", 10) if lanes else ("< 5", 5)
        res.fig(f"idle_redis_cpu_{w}w_{label}", 100 * out["redis_cpu_share_of_one_core"], "% of a core",
                target=target, check=lambda v, limit=limit: v < limit,
                note=f"{out['commands_per_s_total']:g} commands/s, {out['connected_clients']} clients")
    res.details["limits"] = {k: res.details["idle_lanes_off"][k]
                             for k in ("ulimit_n_soft", "ulimit_n_hard", "maxclients", "maxclients_needed")}
    runs: dict[int, list[dict[str, Any]]] = {4: [], big: []}
    for k in range(cfg.fleet_runs):  # alternated, so a slow spell of the machine hits both sizes
        for size, hosts in ((4, min(procs, 4)), (big, procs)):
            runs[size].append(ceiling(server, new_run_dir(base, f"fleet-ceiling-{size}-{k}"), size, hosts,
                                      cfg.fleet_requests))
    small = statistics.median(r["rps"] for r in runs[4])
    large = statistics.median(r["rps"] for r in runs[big])
    res.details["ceiling_4w"], res.details[f"ceiling_{big}w"] = runs[4], runs[big]
    spread = {size: f"{min(r['rps'] for r in rs):,.0f}-{max(r['rps'] for r in rs):,.0f}" for size, rs in runs.items()}
    res.fig("ceiling_4w_rps", small, "req/s", note=f"median of {cfg.fleet_runs}: {spread[4]}")
    res.fig(f"ceiling_{big}w_rps", large, "req/s", note=f"median of {cfg.fleet_runs}: {spread[big]}")
    res.fig(f"ceiling_{big}w_vs_4w", large / small, "x", target=">= 0.9", check=lambda v: v >= 0.9, note="medians")
    res.details["how"] = (f"{w} Worker instances (synthetic engine, 0 ms/token, max_inflight 256, default block, "
                          f"claim_idle 30 s, heartbeat 2 s) in {procs} host processes (benchmarks/proc_fleet.py); "
                          f"start: host processes started to every heartbeat (and, with lanes, every lane owned "
                          f"once); idle: redis-server CPU (INFO cpu) over {cfg.fleet_idle_s:g} s with no requests, "
                          f"after a settle; ceiling: {cfg.fleet_requests} requests, producer process -> {big} "
                          f"workers -> one consumer process, against 4 workers, {cfg.fleet_runs} runs of each, "
                          "alternated; maxclients raised to 8 per worker + 256")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fleet", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    from benchmarks.sections import Config

    defaults = Config()  # (the bench section's own defaults: one place for both entry points)
    ap.add_argument("--workers", type=int, default=defaults.fleet_workers)
    ap.add_argument("--ceiling-workers", type=int, default=defaults.fleet_ceiling_workers,
                    help="the fleet compared with 4 workers at the ceiling")
    ap.add_argument("--processes", type=int, default=defaults.fleet_processes)
    ap.add_argument("--idle-s", type=float, default=defaults.fleet_idle_s)
    ap.add_argument("--requests", type=int, default=defaults.fleet_requests)
    ap.add_argument("--runs", type=int, default=defaults.fleet_runs, help="ceiling runs per fleet size")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args(argv)
    from benchmarks.bench import main as bench_main

    extra = ["--json-out", a.json_out] if a.json_out else []
    return bench_main(["--only", "fleet", "--workers", str(a.workers), "--fleet-processes", str(a.processes),
                       "--fleet-ceiling-workers", str(a.ceiling_workers),
                       "--fleet-idle-s", str(a.idle_s), "--fleet-requests", str(a.requests), "--fleet-runs", str(a.runs), *extra])


if __name__ == "__main__":
    sys.exit(main())
