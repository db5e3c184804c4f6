"""What the per-request event log (``event_log``, ``redroll trace``) costs the queue ceiling.

    python -m benchmarks.event_log [--requests 20000] [--runs 3] [--json-out FILE]

The suite's ceiling run (producer process → one synthetic worker, 0 ms → one consumer group, see
``benchmarks.runs.queue_run``) with the event log on (``--mode``: all or incidents) and off
(``REDROLL_EVENT_LOG``), alternated in
pairs on one redis-server, ``--runs`` pairs. Printed: each side's rate (median and range), the
ratio of each pair (on / off: the budget is at least 0.95), redis-server CPU per request, and the
memory the logs of a run hold (``used_memory`` after the run, on less off, per request; the logs
expire ``event_log_ttl_s`` after their last event).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from benchmarks.harness import Server, emit_json, make_base_dir, new_run_dir
from benchmarks.runs import queue_run


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def run(requests: int, runs: int, mode: str = "all") -> dict[str, Any]:
    server = Server()
    base = make_base_dir()
    rates: dict[str, list[float]] = {"on": [], "off": []}
    server_us: dict[str, list[float]] = {"on": [], "off": []}
    memory: dict[str, list[int]] = {"on": [], "off": []}
    try:
        for k in range(runs):
            # (alternating which side goes first: a shared machine's speed drifts within seconds)
            for side in (("on", "off") if k % 2 == 0 else ("off", "on")):
                env = {"REDROLL_EVENT_LOG": mode if side == "on" else "off"}
                result = queue_run(server, new_run_dir(base, f"event-log-{side}-{k}"), requests, env=env)
                rates[side].append(result.rate)
                server_us[side].append(result.cpu_us_per_item()["redis-server"])
                memory[side].append(server.used_memory())
                print(f"pair {k + 1}, event log {side}: {result.rate:,.0f} req/s, redis-server "
                      f"{server_us[side][-1]:.1f} us/request", flush=True)
    finally:
        server.stop()
    ratios = [on / off for on, off in zip(rates["on"], rates["off"])]
    log_bytes = [(on - off) / requests for on, off in zip(memory["on"], memory["off"])]
    out = {
        "requests": requests, "pairs": runs, "mode": mode,
        "rate_on_rps": _spread(rates["on"]), "rate_off_rps": _spread(rates["off"]),
        "ratio_on_vs_off": _spread(ratios), "ratios": [round(x, 4) for x in ratios],
        "redis_server_us_per_request_on": _spread(server_us["on"]),
        "redis_server_us_per_request_off": _spread(server_us["off"]),
        "log_bytes_per_request": _spread(log_bytes),
        "budget": "ratio >= 0.95",
    }
    print(f"event log on:  {out['rate_on_rps']}")
    print(f"event log off: {out['rate_off_rps']}")
    print(f"on / off per pair: {out['ratios']} (median {out['ratio_on_vs_off']['median']}; budget >= 0.95)")
    print(f"redis-server us/request on {out['redis_server_us_per_request_on']}, "
          f"off {out['redis_server_us_per_request_off']}")
    print(f"memory the logs hold per request: {out['log_bytes_per_request']} bytes")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--runs", type=int, default=3, help="pairs of runs (on, off), alternated")
    p.add_argument("--mode", choices=("all", "incidents"), default="all",
                   help="the event log's mode on the 'on' side (REDROLL_EVENT_LOG)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    emit_json(run(args.requests, args.runs, args.mode), args.json_out)


if __name__ == "__main__":
    main()
