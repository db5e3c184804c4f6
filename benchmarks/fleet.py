"""Fleet scale: what dozens of workers cost one redis-server, at idle and at the ceiling.

    python -m benchmarks.fleet [--workers 64] [--processes 8] [--idle-s 20] [--requests 20000] [--runs 3]

Also the bench's ``fleet`` section (``python -m benchmarks.bench --only fleet --workers 64``).
The workers are full ``Worker`` instances on the synthetic engine (0 ms per token), spread over
``--processes`` host processes (``benchmarks/proc_fleet.py``), with the default block, claim-idle
and heartbeat settings; each has its own name and connections, so Redis sees ``--workers`` workers.

- idle: the fleet registered and settled, no requests: redis-server CPU over ``--idle-s`` as a
  share of one core, and the commands per second behind it; affinity lanes off, then on
  (L = 4 x workers, the setting the affinity bench found best).
- ceiling: ``--requests`` requests (producer process, ``send``) through the fleet to one consumer
  process, against the same run with 4 workers: the ratio says what the fleet's size costs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import Procs, Server, new_run_dir, redroll_env, wait_for
from benchmarks.results import SectionResult
from benchmarks.runs import NAMESPACE, PY, pipeline_run, producer_argv

WORKERS_KEY = "{" + NAMESPACE + "}:workers"


def host_argvs(workers: int, processes: int) -> list[list[str]]:
    """``processes`` host processes with ``workers`` workers between them (as even as it goes)."""
    processes = max(1, min(processes, workers))
    counts = [workers // processes + (1 if i < workers % processes else 0) for i in range(processes)]
    return [[PY, "-m", "benchmarks.proc_fleet", "--workers", str(c)] for c in counts]


def idle(server: Server, run_dir: Path, workers: int, processes: int, seconds: float, lanes: int) -> dict[str, Any]:
    server.fresh()
    env = redroll_env(server, NAMESPACE, REDROLL_AFFINITY_LANES=lanes)
    with Procs(run_dir) as procs:
        for i, argv in enumerate(host_argvs(workers, processes)):
            procs.spawn(f"host{i}", argv, env)
        wait_for(lambda: server.r.hlen(WORKERS_KEY) >= workers, 120, f"{workers} workers to register", procs=procs)
        time.sleep(min(5.0, seconds / 2))  # past start-up (script loads, group creation, first reclaim pass)
        server.r.config_resetstat()
        r0, t0 = server.cpu_s(), time.monotonic()
        time.sleep(seconds)
        r1, t1 = server.cpu_s(), time.monotonic()
        stats = server.r.info("commandstats")
        procs.check_alive()
        registered = server.r.hlen(WORKERS_KEY)
    elapsed = t1 - t0
    shown = [(name.removeprefix("cmdstat_"), st) for name, st in sorted(stats.items(), key=lambda kv: -kv[1]["usec"])
             if st["calls"] and not name.startswith(("cmdstat_config", "cmdstat_info"))]
    per_s = {name: round(st["calls"] / elapsed, 1) for name, st in shown}
    # (a script's time includes the commands it runs, which are listed too)
    busy = {name: round(st["usec"] / elapsed / 1e4, 3) for name, st in shown}
    return {"workers": workers, "registered": registered, "affinity_lanes": lanes, "seconds": round(elapsed, 1),
            "redis_cpu_share_of_one_core": round((r1 - r0) / elapsed, 4), "commands_per_s": per_s,
            "command_time_pct_of_one_core": busy,
            "commands_per_s_total": round(sum(per_s.values()), 1)}


def ceiling(server: Server, run_dir: Path, workers: int, processes: int, requests: int) -> dict[str, Any]:
    def all_registered() -> dict:
        wait_for(lambda: server.r.hlen(WORKERS_KEY) >= workers, 120, f"{workers} workers to register")
        return {}

    run = pipeline_run(server, run_dir, count=requests, workers=host_argvs(workers, processes),
                       producer=producer_argv(requests, run_dir / "producer.json", chunk=500),
                       on_ready=all_registered, timeout=max(120, requests / 50))
    return {"workers": workers, "requests": requests, "rps": round(run.rate, 1), "elapsed_s": round(run.elapsed, 3),
            "cpu_us_per_request": run.cpu_us_per_item()}


def fleet(server: Server, cfg: Any, base: Path, res: SectionResult) -> None:
    w, procs = cfg.fleet_workers, cfg.fleet_processes
    for lanes in (0, 4 * w):
        out = idle(server, new_run_dir(base, f"fleet-idle-l{lanes}"), w, procs, cfg.fleet_idle_s, lanes)
        label = "lanes_on" if lanes else "lanes_off"
        res.details[f"idle_{label}"] = out
        res.fig(f"idle_redis_cpu_{w}w_{label}", 100 * out["redis_cpu_share_of_one_core"], "% of a core",
                target="< 5", check=lambda v: v < 5, note=f"{out['commands_per_s_total']:g} commands/s")
    runs: dict[int, list[dict[str, Any]]] = {4: [], w: []}
    for k in range(cfg.fleet_runs):  # alternated, so a slow spell of the machine hits both sizes
        for size, hosts in ((4, min(procs, 4)), (w, procs)):
            runs[size].append(ceiling(server, new_run_dir(base, f"fleet-ceiling-{size}-{k}"), size, hosts,
                                      cfg.fleet_requests))
    small = statistics.median(r["rps"] for r in runs[4])
    big = statistics.median(r["rps"] for r in runs[w])
    res.details["ceiling_4w"], res.details[f"ceiling_{w}w"] = runs[4], runs[w]
    spread = {size: f"{min(r['rps'] for r in rs):,.0f}-{max(r['rps'] for r in rs):,.0f}" for size, rs in runs.items()}
    res.fig("ceiling_4w_rps", small, "req/s", note=f"median of {cfg.fleet_runs}: {spread[4]}")
    res.fig(f"ceiling_{w}w_rps", big, "req/s", note=f"median of {cfg.fleet_runs}: {spread[w]}")
    res.fig(f"ceiling_{w}w_vs_4w", big / small, "x", target=">= 0.9", check=lambda v: v >= 0.9, note="medians")
    res.details["how"] = (f"{w} Worker instances (synthetic engine, 0 ms/token, max_inflight 256, default block "
                          f"1 s, claim_idle 30 s, heartbeat 2 s) in {procs} host processes (benchmarks/proc_fleet.py); "
                          f"idle: redis-server CPU (INFO cpu) over {cfg.fleet_idle_s:g} s with no requests, after a "
                          f"settle; ceiling: {cfg.fleet_requests} requests, producer process -> fleet -> one "
                          f"consumer process, against 4 workers, {cfg.fleet_runs} runs of each, alternated")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fleet", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    from benchmarks.sections import Config

    defaults = Config()  # (the bench section's own defaults: one place for both entry points)
    ap.add_argument("--workers", type=int, default=defaults.fleet_workers)
    ap.add_argument("--processes", type=int, default=defaults.fleet_processes)
    ap.add_argument("--idle-s", type=float, default=defaults.fleet_idle_s)
    ap.add_argument("--requests", type=int, default=defaults.fleet_requests)
    ap.add_argument("--runs", type=int, default=defaults.fleet_runs, help="ceiling runs per fleet size")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args(argv)
    from benchmarks.bench import main as bench_main

    extra = ["--json-out", a.json_out] if a.json_out else []
    return bench_main(["--only", "fleet", "--workers", str(a.workers), "--fleet-processes", str(a.processes),
                       "--fleet-idle-s", str(a.idle_s), "--fleet-requests", str(a.requests), "--fleet-runs", str(a.runs), *extra])


if __name__ == "__main__":
    sys.exit(main())
