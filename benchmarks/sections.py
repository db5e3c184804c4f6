"""The benchmark sections: ceiling, latency, utilisation, large, memory (peers: benchmarks.peers_section)."""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import time
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from benchmarks.harness import BenchError, Procs, Server, new_run_dir, percentile, read_json, redroll_env, wait_for
from benchmarks.results import SectionResult
from benchmarks.runs import (
    NAMESPACE,
    PY,
    bench_worker_argv,
    pipeline_run,
    producer_argv,
    queue_run,
    redroll_worker_argv,
)

MB = 1024 * 1024


@dataclass
class Config:
    quick: bool = False
    ceiling_requests: int = 20_000
    latency_requests: int = 3_000
    latency_rate: float = 200.0
    latency_token_ms: float = 0.25
    util_slots: int = 32
    util_token_ms: float = 20.0
    util_tokens: int = 16
    util_rounds: int = 15
    large_records: int = 200
    large_n: int = 8
    large_tokens: int = 4096
    large_runs: int = 5
    """End-to-end runs of the large-record flow (the median is the figure)."""
    memory_requests: int = 100_000
    memory_dedup_window_s: int = 5
    peer_jobs: int = 3_000
    peer_runs: int = 5
    fleet_workers: int = 1024
    fleet_ceiling_workers: int = 256
    """The fleet compared with 4 workers at the ceiling (0: ``fleet_workers``)."""
    fleet_processes: int = 8
    fleet_idle_s: float = 20.0
    fleet_requests: int = 20_000
    fleet_runs: int = 3
    submit_runs: int = 3

    @classmethod
    def make(cls, quick: bool) -> "Config":
        if not quick:
            return cls()
        return cls(quick=True, ceiling_requests=2_000, latency_requests=300, util_slots=8, util_token_ms=5.0,
                   util_tokens=8, util_rounds=6, large_records=12, large_runs=1, memory_requests=3_000,
                   memory_dedup_window_s=1, peer_jobs=300, peer_runs=1, fleet_workers=8, fleet_ceiling_workers=8, fleet_processes=2,
                   fleet_idle_s=3.0, fleet_requests=2_000, fleet_runs=1, submit_runs=1)


def _stats_ms(values: list[float]) -> dict[str, float]:
    return {"p50": round(percentile(values, 50), 3), "p90": round(percentile(values, 90), 3),
            "p99": round(percentile(values, 99), 3), "max": round(max(values), 3),
            "mean": round(statistics.fmean(values), 3), "n": len(values)}


# ====================================================================== 1. ceiling


def ceiling(server: Server, cfg: Config, base: Path, res: SectionResult) -> None:
    n = cfg.ceiling_requests
    run_dir = new_run_dir(base, "ceiling")
    commands: dict[str, Any] = {}
    run = queue_run(server, run_dir, n, on_ready=lambda: server.r.config_resetstat() and None,
                    after_done=lambda _procs: commands.update(server_commands(server, n)))
    res.details["redroll"] = {
        "requests": n, "elapsed_s": round(run.elapsed, 3),
        "producer_submit_s": round(run.producer["t_last"] - run.producer["t_first"], 3),
        "request_data_bytes": run.producer.get("data_bytes"),
        "cpu_us_per_request": run.cpu_us_per_item(),
        "redis_commands_per_request": commands,
        "how": "producer process: producer.client.send, 500 per pipelined round trip; worker: `python -m "
               "redroll.cli.main worker --engine synthetic --token-ms 0 --max-inflight 256`; consumer: `python -m "
               "redroll.cli.main consume --group bench --handler h=benchmarks.bench_handlers:count` (in-process "
               "counter, one file write at the last callback); timed from first submit to last callback",
    }
    raw = {}
    for mode in ("sync", "async"):
        raw[mode] = raw_three_hop(server, new_run_dir(base, f"raw-{mode}"), n, mode)
        res.details[f"raw_{mode}"] = {"requests": n, "elapsed_s": round(raw[mode]["elapsed"], 3),
                                      "cpu_us_per_request": raw[mode]["cpu_us"],
                                      "redis_commands_per_request": raw[mode]["commands"]}
    # Short runs on a shared machine move by 20% or more (its speed drifts within seconds), so the
    # API and raw sync runs alternate in pairs and the medians are compared, as are the command
    # line's runs against the API's; the CPU and command figures are the first pair's.
    api, raw_sync, subs = [run.rate], [raw["sync"]["rate"]], []
    for k in range(cfg.submit_runs):
        subs.append(submit_wait(server, new_run_dir(base, f"submit-{k}"), n))
        if k < cfg.submit_runs - 1:
            api.append(queue_run(server, new_run_dir(base, f"ceiling-again-{k}"), n).rate)
            raw_sync.append(raw_three_hop(server, new_run_dir(base, f"raw-sync-again-{k}"), n, "sync")["rate"])
    pairs = [a / b for a, b in zip(api, raw_sync)]
    best_raw = max(statistics.median(raw_sync), raw["async"]["rate"])
    res.fig("redroll_rps", statistics.median(api), "req/s", note=f"median of {len(api)} runs")
    res.fig("raw_sync_rps", statistics.median(raw_sync), "req/s", note=f"median of {len(raw_sync)} runs")
    res.fig("raw_async_rps", raw["async"]["rate"], "req/s")
    res.fig("ratio_vs_raw", statistics.median(pairs), "x", target=">= 0.40", check=lambda v: v >= 0.40,
            note=f"redroll / raw sync (the faster raw variant here): median of {len(pairs)} alternated pairs")
    res.details["ratio_pairs"] = {"redroll_rps": [round(x, 1) for x in api], "raw_sync_rps": [round(x, 1) for x in raw_sync],
                                  "ratios": [round(x, 4) for x in pairs]}
    res.details["ratio_vs_raw_sync"] = round(run.rate / raw["sync"]["rate"], 4)
    res.details["ratio_vs_raw_async"] = round(run.rate / raw["async"]["rate"], 4)
    res.details["ratio_bound"] = bound = ratio_bound(res.details, best_raw, n)
    res.fig("ratio_bound", bound["ratio"], "x",
            note="what a zero-cost asyncio client keeping redroll's redis-side work could reach here")
    cpu = run.cpu_us_per_item()
    busy = {k: round(v / run.elapsed, 3) for k, v in run.cpu_s.items()}
    busy["redis-server"] = round(run.redis_cpu_s / run.elapsed, 3)
    res.details["redroll"]["cores_busy"] = busy
    if "worker0" in busy:
        res.fig("redroll_worker_cores_busy", busy["worker0"], "cores",
                note="the worker's CPU over the run: every request passes its one thread, so near 1 its CPU "
                     "per request sets the ceiling (details.redroll.cores_busy: every process)")
    res.fig("redroll_server_us_per_request", cpu["redis-server"], "us", target="<= 15", check=lambda v: v <= 15,
            note="redis-server CPU; the commands behind it are in details.redroll.redis_commands_per_request")
    res.fig("raw_sync_server_us_per_request", raw["sync"]["cpu_us"]["redis-server"], "us")
    res.fig("redroll_clients_us_per_request", sum(v for k, v in cpu.items() if k != "redis-server"), "us",
            note=", ".join(f"{k} {v:g}" for k, v in cpu.items() if k != "redis-server"))
    res.fig("raw_sync_clients_us_per_request",
            sum(v for k, v in raw["sync"]["cpu_us"].items() if k != "redis-server"), "us",
            note=", ".join(f"{k} {v:g}" for k, v in raw["sync"]["cpu_us"].items() if k != "redis-server"))
    res.details["raw_how"] = ("same bytes, same three processes: producer pipelined XADD (500 per round trip); "
                              "worker XREADGROUP COUNT 256 -> one pipeline of XADD(result) per entry + one XACK; "
                              "consumer XREADGROUP COUNT 256 -> XACK. No XDEL, no decoding, no Lua.")
    sub_rate, api_rate = statistics.median(x["rate"] for x in subs), statistics.median(api)
    res.details["submit_wait"] = {"runs": subs, "api_rps_runs": [round(x, 1) for x in api]}
    res.fig("submit_wait_rps", sub_rate, "req/s",
            note=f"`redroll submit FILE --wait --out OUT`, process start to exit; median of {len(subs)}")
    res.fig("submit_wait_vs_api", sub_rate / api_rate, "x", target=">= 0.8", check=lambda v: v >= 0.8,
            note=f"medians, {len(subs)} submit runs alternated with {len(api)} API runs (redroll_rps)")


def server_commands(server: Server, n: int) -> dict[str, dict[str, float]]:
    """INFO commandstats since the last CONFIG RESETSTAT, per request: calls and server microseconds
    of each command (a script's own figure includes the commands it runs, which are also listed)."""
    out = {}
    for name, st in sorted(server.r.info("commandstats").items(), key=lambda kv: -kv[1]["usec"]):
        if st["calls"] and not name.startswith(("cmdstat_config", "cmdstat_info", "cmdstat_client")):
            out[name.removeprefix("cmdstat_")] = {"calls": round(st["calls"] / n, 3), "us": round(st["usec"] / n, 2)}
    return out


def submit_wait(server: Server, run_dir: Path, n: int) -> dict[str, Any]:
    """`redroll submit FILE --wait --out OUT` of ``n`` JSON lines against one synthetic worker process:
    what a batch-generation user runs. Timed from starting the command to its exit (interpreter start,
    reading and validating the whole file, every record written and flushed)."""
    import json

    from benchmarks.payload import input_ids, request_id

    src, out = run_dir / "requests.jsonl", run_dir / "records.jsonl"
    with open(src, "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"request_id": request_id(i % 7), "input_ids": input_ids(i),
                                 "sampling_params": {"max_new_tokens": 8}, "callback": "h"}) + "\n")
    server.fresh()
    env = redroll_env(server, NAMESPACE)
    with Procs(run_dir) as procs:
        procs.spawn("worker0", redroll_worker_argv(token_ms=0, max_inflight=256), env)
        wait_for(lambda: server.r.hlen("{" + NAMESPACE + "}:workers") >= 1, 60, "the worker", procs=procs)
        w0, r0 = procs.sample_cpu()["worker0"], server.cpu_s()
        t0 = time.perf_counter()
        with open(run_dir / "submit.log", "wb") as log:
            p = subprocess.Popen([PY, "-m", "redroll.cli", "submit", str(src), "--wait", "--out", str(out)],
                                 env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)
            _pid, status, usage = os.wait4(p.pid, 0)
        elapsed = time.perf_counter() - t0
        w1, r1 = procs.sample_cpu()["worker0"], server.cpu_s()
    if os.waitstatus_to_exitcode(status) != 0:
        raise BenchError(f"redroll submit exited with {os.waitstatus_to_exitcode(status)}:\n"
                         + (run_dir / "submit.log").read_text(errors="replace")[-2000:])
    lines = sum(1 for _ in open(out, "rb"))
    if lines != n:
        raise BenchError(f"redroll submit wrote {lines} records, not {n}")
    return {"requests": n, "rate": round(n / elapsed, 1), "elapsed_s": round(elapsed, 3),
            "cpu_us_per_request": {"submit": round((usage.ru_utime + usage.ru_stime) * 1e6 / n, 1),
                                   "worker0": round((w1 - w0) * 1e6 / n, 1),
                                   "redis-server": round((r1 - r0) * 1e6 / n, 1)}}


def ratio_bound(details: dict[str, Any], best_raw: float, n: int) -> dict[str, Any]:
    """The best ratio an asyncio pipeline that keeps redroll's promises could reach on this machine.

    Its floor is the raw asyncio clients' CPU (bare redis-py calls: no decoding, validation or
    engine) plus the redis-server CPU of redroll's own commands (Lua de-duplication and fencing,
    callback markers). With every core as busy as the raw sync flow keeps them, that CPU per
    request sets the rate.
    """
    raw_async = details["raw_async"]["cpu_us_per_request"]
    floor_us = sum(v for k, v in raw_async.items() if k != "redis-server") \
        + details["redroll"]["cpu_us_per_request"]["redis-server"]
    sync = details["raw_sync"]
    cores_busy = sum(sync["cpu_us_per_request"].values()) * n / 1e6 / sync["elapsed_s"]
    rate = cores_busy / (floor_us / 1e6)
    return {"floor_cpu_us_per_request": round(floor_us, 1), "cores": os.cpu_count(),
            "cores_busy_in_raw_sync": round(cores_busy, 2), "rate": round(rate), "ratio": round(rate / best_raw, 4),
            "how": "(raw asyncio clients' CPU + redroll's redis-server CPU) per request, at the raw sync "
                   "flow's core use; a zero-cost redroll client could not beat this"}


def raw_three_hop(server: Server, run_dir: Path, n: int, mode: str, rate: float = 0.0) -> dict[str, Any]:
    """The bare redis-py three hops (``benchmarks.proc_raw``): flat out, or with ``rate`` > 0 paced
    one entry per round trip, which adds the consumer's ``samples_ms`` (the path's latency floor)."""
    server.fresh()
    ns = "raw"
    server.r.xgroup_create("{raw}:requests", "workers", id="0", mkstream=True)
    server.r.xgroup_create("{raw}:results", "bench", id="0", mkstream=True)
    outs = {role: run_dir / f"{role}.json" for role in ("producer", "worker", "consumer")}

    def argv(role: str) -> list[str]:
        return [PY, "-m", "benchmarks.proc_raw", "--role", role, "--mode", mode, "--url", server.url,
                "--namespace", ns, "--count", str(n), "--rate", str(rate), "--out", str(outs[role])]

    env = redroll_env(server, ns)
    roles = ("producer", "worker", "consumer")
    with Procs(run_dir) as procs:
        procs.spawn("worker", argv("worker"), env)
        procs.spawn("consumer", argv("consumer"), env)
        wait_for(lambda: len(server.r.client_list()) >= 3, 30, "raw worker and consumer to connect", procs=procs)
        time.sleep(0.2)
        server.r.config_resetstat()
        r0 = server.cpu_s()
        procs.spawn("producer", argv("producer"), env)
        wait_for(lambda: all(o.exists() for o in outs.values()), max(60, n / 200, 3 * n / rate if rate else 0),
                 f"the raw {mode} run",
                 procs=procs, allow_exited=roles)
        r1 = server.cpu_s()
        commands = server_commands(server, n)
    rep = {role: read_json(o) for role, o in outs.items()}
    elapsed = rep["consumer"]["t_last"] - rep["producer"]["t_first"]
    cpu = {role: round(rep[role]["cpu_s"] * 1e6 / n, 1) for role in roles}
    cpu["redis-server"] = round((r1 - r0) * 1e6 / n, 1)
    return {"rate": n / elapsed, "elapsed": elapsed, "cpu_us": cpu, "commands": commands,
            "samples_ms": rep["consumer"].get("samples_ms") or [], "check_ms": rep["consumer"].get("check_ms") or []}


# ====================================================================== 2. latency


def latency(server: Server, cfg: Config, base: Path, res: SectionResult) -> None:
    n, rate = cfg.latency_requests, cfg.latency_rate
    warm = min(50, n // 10)
    # (a) the in-process Producer, private reply stream, one worker process
    run_dir = new_run_dir(base, "latency-producer")
    server.fresh()
    with Procs(run_dir) as procs:
        procs.spawn("worker", redroll_worker_argv(token_ms=cfg.latency_token_ms, max_inflight=256),
                    redroll_env(server, NAMESPACE))
        wait_for(lambda: server.r.hlen("{" + NAMESPACE + "}:workers") >= 1, 60, "the worker", procs=procs)
        samples = asyncio.run(_latency_producer(server, n, rate))
        procs.check_alive()
    added = [s["added_ms"] for s in samples[warm:]]
    res.fig("producer_p50_added_ms", percentile(added, 50), "ms", target="< 2", check=lambda v: v < 2)
    res.fig("producer_p99_added_ms", percentile(added, 99), "ms", target="< 10", check=lambda v: v < 10)
    res.details["producer_path"] = {
        "added_ms": _stats_ms(added),
        "queue_ms": _stats_ms([s["queue_ms"] for s in samples[warm:]]),
        "engine_ms": _stats_ms([s["engine_ms"] for s in samples[warm:]]),
        "submit_call_ms": _stats_ms([s["submit_ms"] for s in samples[warm:]]),
        "how": f"{n} requests paced at {rate:g}/s, each `await producer.submit(...)` (in this process, private "
               f"reply stream); added = (callback time - time before submit) - meta_info.engine_ms; first {warm} "
               f"dropped as warm-up; worker: redroll.cli.main worker --engine synthetic --token-ms "
               f"{cfg.latency_token_ms:g}, max_new_tokens 8",
    }
    # (b) the consumer path: producer process (send) -> worker -> consumer-group callback
    run_dir = new_run_dir(base, "latency-consumer")
    out = run_dir / "producer.json"
    run = pipeline_run(server, run_dir, count=n,
                       workers=[redroll_worker_argv(token_ms=cfg.latency_token_ms, max_inflight=256)],
                       producer=producer_argv(n, out, rate=rate), handler="latency", timeout=max(60, 3 * n / rate))
    rows = run.consumer.get("samples") or []
    added_c = [total - eng for total, eng, _q in rows[warm:]]
    if not added_c:
        raise BenchError("the latency handler recorded no samples")
    res.fig("consumer_p50_added_ms", percentile(added_c, 50), "ms", target="< 2", check=lambda v: v < 2)
    res.fig("consumer_p99_added_ms", percentile(added_c, 99), "ms", target="< 10", check=lambda v: v < 10)
    # (c) the machine's floor for the consumer path's hops: bare redis-py, same rate and bytes
    raw = raw_three_hop(server, new_run_dir(base, "latency-floor"), n, "async", rate=rate)
    floor, checks = raw["samples_ms"][warm:], raw["check_ms"][warm:]
    if not floor or len(checks) != len(floor):
        raise BenchError("the raw paced run recorded no samples, or not one check per sample")
    with_check = [hops + check for hops, check in zip(floor, checks)]
    res.fig("raw_floor_p50_ms", percentile(floor, 50), "ms",
            note="bare redis-py three hops at the same rate: producer -> worker -> consumer, no redroll")
    res.fig("raw_floor_p99_ms", percentile(floor, 99), "ms")
    res.fig("raw_floor_with_check_p50_ms", percentile(with_check, 50), "ms",
            note="the same three hops and the consumer's one more round trip after its read (redroll's "
                 "markers check, which comes before any callback): the consumer path's floor")
    res.fig("raw_floor_with_check_p99_ms", percentile(with_check, 99), "ms")
    res.details["raw_floor"] = {
        "ms": _stats_ms(floor),
        "check_ms": _stats_ms(checks),
        "with_check_ms": _stats_ms(with_check),
        "consumer_added_over_floor_p50_ms": round(percentile(added_c, 50) - percentile(floor, 50), 3),
        "consumer_added_over_floor_with_check_p50_ms": round(percentile(added_c, 50) - percentile(with_check, 50), 3),
        "how": f"benchmarks.proc_raw --mode async --rate {rate:g}: the producer XADDs one request entry (the same "
               f"bytes) per round trip, stamped with time.time() just before; the worker (XREADGROUP BLOCK) XADDs "
               f"a result entry of a record's size carrying the stamp, and XACKs; the consumer (XREADGROUP BLOCK) "
               f"takes its read time minus the stamp, then makes one more round trip (SMISMEMBER of the read's "
               f"rids: check_ms) before its XACK. No decoding, de-duplication, Lua or engine: what waking three "
               f"processes and Redis costs on this machine at this rate, under the consumer path's figure; "
               f"with_check_ms adds each entry's check, the round trip a consumer that skips records it applied "
               f"before cannot leave out",
    }
    res.details["consumer_path"] = {
        "added_ms": _stats_ms(added_c),
        "queue_ms": _stats_ms([q for _t, _e, q in rows[warm:]]),
        "engine_ms": _stats_ms([e for _t, e, _q in rows[warm:]]),
        "how": f"producer process sends one request per round trip at {rate:g}/s with meta_info.bench_submitted_at "
               f"= time.time() just before send; the consumer's handler takes time.time() - bench_submitted_at - "
               f"engine_ms (same host clock)",
    }


async def _latency_producer(server: Server, n: int, rate: float) -> list[dict[str, float]]:
    from benchmarks.payload import make_requests
    from redroll.producer.client import Producer
    from redroll.shared.settings import Settings

    settings = Settings(redis_url=server.url, namespace=NAMESPACE)
    arrived: dict[str, float] = {}
    records: dict[str, Any] = {}
    sent: dict[str, tuple[float, float]] = {}

    def on_record(rec: Any) -> None:
        arrived[rec.request_id] = time.perf_counter()
        records[rec.request_id] = rec

    async with Producer(settings, name="bench-latency", block_ms=1000) as producer:
        loop = asyncio.get_running_loop()
        start = loop.time()
        futures = []
        for i, req in enumerate(make_requests(n, callback=None)):
            delay = start + i / rate - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            req.submitted_at = time.time()  # (made before the pacing sleep)
            t0 = time.perf_counter()
            futures.append(await producer.submit(req, callback=on_record))
            sent[req.request_id] = (t0, time.perf_counter())
        await asyncio.wait_for(asyncio.gather(*futures), timeout=60)
    out = []
    for rid, (t0, t1) in sent.items():
        meta = records[rid].meta_info
        total = (arrived[rid] - t0) * 1000.0
        out.append({"added_ms": total - float(meta["engine_ms"]), "queue_ms": float(meta["queue_ms"]),
                    "engine_ms": float(meta["engine_ms"]), "submit_ms": (t1 - t0) * 1000.0})
    return out


# ====================================================================== 3. utilisation


def utilisation(server: Server, cfg: Config, base: Path, res: SectionResult) -> None:
    C, t, tokens, rounds = cfg.util_slots, cfg.util_token_ms, cfg.util_tokens, cfg.util_rounds
    ideal = C / (tokens * t / 1000.0)
    # direct: the engine in one process, C requests in flight at all times
    run_dir = new_run_dir(base, "util-direct")
    out = run_dir / "direct.json"
    with Procs(run_dir) as procs:
        p = procs.spawn("direct", [PY, "-m", "benchmarks.proc_worker", "--engine", "slots", "--slots", str(C),
                                   "--token-ms", str(t), "--direct", str(C * rounds), "--concurrency", str(C),
                                   "--max-new-tokens", str(tokens), "--stats-out", str(out)],
                        redroll_env(server, NAMESPACE))
        wait_for(lambda: out.exists(), 60 + rounds * tokens * t / 1000 * 3, "the direct run", procs=procs,
                 allow_exited=("direct",))
        p.popen.wait(10)
    direct = read_json(out)
    direct_rate = direct["count"] / (direct["t_last"] - direct["t_first"])
    res.fig("direct_rps", direct_rate, "req/s", note=f"ideal {ideal:.1f}")
    res.details["engine"] = {"slots": C, "token_ms": t, "max_new_tokens": tokens, "ideal_rps_per_engine": ideal,
                             "direct_occupancy": round(direct["occupancy"], 4), "direct_requests": direct["count"]}
    runs: dict[str, Any] = {}
    for workers in (1, 4):
        for inflight_mult in (2, 1):
            inflight = C * inflight_mult
            count = workers * C * rounds
            run_dir = new_run_dir(base, f"util-w{workers}-i{inflight}")
            stats_files = [run_dir / f"engine{i}.json" for i in range(workers)]
            run = pipeline_run(
                server, run_dir, count=count,
                workers=[bench_worker_argv(engine="slots", max_inflight=inflight, slots=C, token_ms=t,
                                           stats_out=f) for f in stats_files],
                producer=producer_argv(count, run_dir / "producer.json", max_new_tokens=tokens),
                timeout=60 + 5 * rounds * tokens * t / 1000)
            engines = [read_json(f) or {} for f in stats_files]
            ratio = run.rate / (workers * direct_rate)
            key = f"w{workers}_inflight{inflight_mult}C"
            runs[key] = {"workers": workers, "max_inflight": inflight, "requests": count,
                         "rps": round(run.rate, 2), "ratio": round(ratio, 4),
                         "engine_occupancy": [round(e.get("occupancy", 0.0), 4) for e in engines],
                         "engine_late_s": [round(e.get("late_s", 0.0), 3) for e in engines],
                         "cpu_us_per_request": run.cpu_us_per_item()}
            if inflight_mult == 2:
                res.fig(f"ratio_{workers}w", ratio, "x", target=">= 0.95", check=lambda v: v >= 0.95,
                        note=f"max_inflight = 2 x slots ({inflight})")
            else:
                res.fig(f"ratio_{workers}w_inflight_eq_slots", ratio, "x",
                        note=f"max_inflight = slots ({inflight})")
    res.details["runs"] = runs
    res.details["how"] = ("benchmarks.engines.SlotEngine: C slots decode together, one token per slot per step of "
                          "token_ms; direct = one process keeping C requests in the engine at all times; pipeline "
                          "= producer process bursts workers*C*rounds requests, W processes each run "
                          "engine_worker.worker.Worker on its own SlotEngine (benchmarks/proc_worker.py), one "
                          "consumer process; ratio = pipeline req/s / (W x direct req/s)")


# ====================================================================== 4. large


def packed_arrays_cost(ids: list[list[int]], logprobs: list[list[float]], timed: Callable[..., float],
                       min_s: float) -> dict[str, Any]:
    """The same ids and logprobs as packed int32 / float32 byte strings inside msgpack, against the
    msgpack lists the wire format uses: bytes, pack time, and unpack time back to Python lists
    (what a callback gets). For the record: the wire format keeps lists (see the README)."""
    import msgpack

    lists = {"ids": ids, "logprobs": logprobs}

    def pack_arrays() -> bytes:
        return msgpack.packb({"ids": [array("i", s).tobytes() for s in ids],
                              "logprobs": [array("f", s).tobytes() for s in logprobs]})

    packed_bytes = pack_arrays()

    def unpack_arrays() -> tuple[list, list]:
        obj = msgpack.unpackb(packed_bytes)
        return [array("i", b).tolist() for b in obj["ids"]], [array("f", b).tolist() for b in obj["logprobs"]]

    list_bytes = msgpack.packb(lists)
    return {
        "lists_bytes": len(list_bytes), "arrays_bytes": len(packed_bytes),
        "lists_pack_ms": round(timed(lambda: msgpack.packb(lists), min_s) * 1000, 3),
        "arrays_pack_ms": round(timed(pack_arrays, min_s) * 1000, 3),
        "lists_unpack_ms": round(timed(lambda: msgpack.unpackb(list_bytes), min_s) * 1000, 3),
        "arrays_unpack_to_lists_ms": round(timed(unpack_arrays, min_s) * 1000, 3),
    }


def _command_name(command: bytes | str) -> str:
    """A slowlog entry's command without its arguments; a function call by its script's name."""
    from redroll.shared.functions import LIBRARY

    words = (command.decode(errors="replace") if isinstance(command, bytes) else command).split()
    if len(words) > 1 and words[0].upper() == "FCALL":
        return f"FCALL {words[1].removeprefix(LIBRARY + '_')}"
    return words[0] if words else ""


def large(server: Server, cfg: Config, base: Path, res: SectionResult) -> None:
    import msgpack

    from benchmarks.engines import CannedEngine
    from benchmarks.payload import make_requests
    from redroll.engine_worker.engines.synthetic import SyntheticEngine
    from redroll.engine_worker.records import build_record
    from redroll.shared.codec import decode_record, encode_record
    from redroll.shared.types import RecordStatus

    n, tokens = cfg.large_n, cfg.large_tokens
    engine = CannedEngine()
    req = next(make_requests(1, n=n, max_new_tokens=tokens, logprob=True))
    out = asyncio.run(engine.generate(req, "h"))
    rec = build_record(req, out, status=RecordStatus.FINISHED, worker="worker-benchhost-12345-abcdef",
                       info=engine.info, attempt=1, queue_ms=1.0, engine_ms=1.0)
    fields = encode_record(rec)
    size = len(fields["data"])

    def timed(fn, min_s: float) -> float:
        k, t0 = 0, time.perf_counter()
        while True:
            fn()
            k += 1
            el = time.perf_counter() - t0
            if el >= min_s and k >= 3:
                return el / k

    min_s = 0.3 if cfg.quick else 2.0
    enc_s = timed(lambda: encode_record(rec), min_s)
    dec_s = timed(lambda: decode_record(fields), min_s)
    raw_pack_s = timed(lambda: msgpack.packb(fields["data"] and {"a": rec.output_token_ids,
                                                                 "b": rec.output_logprobs}), min_s / 2)
    raw_unpack_s = timed(lambda: msgpack.unpackb(fields["data"], raw=False), min_s / 2)
    res.fig("encode_MBps", size / enc_s / MB, "MB/s")
    res.fig("decode_MBps", size / dec_s / MB, "MB/s")
    res.fig("record_MB", size / MB, "MB")
    syn = SyntheticEngine()
    t0 = time.perf_counter()
    for i in range(n):
        syn.tokens_for(req, i)
    syn_ms = (time.perf_counter() - t0) * 1000
    res.details["codec"] = {
        "record_bytes": size, "encode_ms": round(enc_s * 1000, 3), "decode_ms": round(dec_s * 1000, 3),
        "plain_msgpack_pack_ms": round(raw_pack_s * 1000, 3), "plain_msgpack_unpack_ms": round(raw_unpack_s * 1000, 3),
        "shape": f"n={n} samples x {tokens} tokens, ids + float logprobs",
        "packed_arrays": packed_arrays_cost(rec.output_token_ids, rec.output_logprobs or [], timed, min_s / 2),
    }
    count = cfg.large_records

    def watch_slow_commands() -> None:
        server.r.config_set("slowlog-log-slower-than", 100)  # µs
        server.r.config_set("slowlog-max-len", 100_000)
        server.r.slowlog_reset()

    def e2e_run(k: int) -> tuple[Any, list]:
        run_dir = new_run_dir(base, f"large-{k}")
        try:
            run = pipeline_run(server, run_dir, count=count,
                               workers=[bench_worker_argv(engine="canned", max_inflight=32)],
                               producer=producer_argv(count, run_dir / "producer.json", chunk=50,
                                                      max_new_tokens=tokens, n=n, logprob=True),
                               timeout=120 + count, on_ready=watch_slow_commands)
            return run, server.r.slowlog_get(100_000)
        finally:
            server.r.config_set("slowlog-log-slower-than", 10_000)

    runs = [e2e_run(k) for k in range(max(1, cfg.large_runs))]
    rates = [r.rate for r, _ in runs]
    run = sorted(runs, key=lambda x: x[0].rate)[len(runs) // 2][0]  # the median run, for the details
    slow = [e for _, log in runs for e in log]
    res.fig("e2e_records_per_s", statistics.median(rates), "records/s")
    res.fig("e2e_MBps", statistics.median(rates) * size / MB, "MB/s")
    longest = max(slow, key=lambda e: e["duration"], default=None)
    res.fig("longest_redis_command_ms", longest["duration"] / 1000.0 if longest else 0.0, "ms",
            note="the longest command redis-server ran during the runs (its slowlog): while it runs, every other "
                 "client of that server waits")
    res.details["slow_commands"] = {
        "over_1ms": sum(1 for e in slow if e["duration"] > 1000),
        "over_10ms": sum(1 for e in slow if e["duration"] > 10_000),
        "longest": _command_name(longest["command"]) if longest else None, "runs": len(runs)}
    res.details["e2e"] = {"records": count, "runs_records_per_s": [round(x, 1) for x in rates],
                          "elapsed_s": round(run.elapsed, 3),
                          "cpu_us_per_record": run.cpu_us_per_item(),
                          "synthetic_engine_generate_ms_per_record": round(syn_ms, 1),
                          "how": "worker: benchmarks/proc_worker.py --engine canned (a precomputed n x tokens "
                                 "output, so the run measures moving records, not the synthetic engine's "
                                 "per-token Python RNG, which alone costs the ms shown above), max_inflight 32; "
                                 "consumer: redroll.cli.main consume with the counting handler"}


# ====================================================================== 6. memory


def memory(server: Server, cfg: Config, base: Path, res: SectionResult) -> None:
    n, window = cfg.memory_requests, cfg.memory_dedup_window_s
    run_dir = new_run_dir(base, "memory")
    applied_pattern = "{" + NAMESPACE + "}:applied:*"
    best = {"members": 0, "bytes": 0}
    peak = {"used_memory": 0}
    marks: dict[str, int] = {}

    def applied_usage() -> tuple[int, int, int]:
        keys = list(server.r.scan_iter(match=applied_pattern, count=1000))
        total = members = 0
        for k in keys:
            total += int(server.r.memory_usage(k, samples=0) or 0)
            members += int(server.r.scard(k))
        return len(keys), total, members

    def sample() -> None:
        _k, total, members = applied_usage()
        if members > best["members"]:
            best.update(members=members, bytes=total)
        peak["used_memory"] = max(peak["used_memory"], server.used_memory())

    breakdown: dict[str, dict] = {}
    fields = ("used_memory", "used_memory_dataset", "used_memory_overhead", "used_memory_scripts",
              "mem_clients_normal", "used_memory_lua")

    def snapshot(label: str) -> int:
        info = server.r.info("memory")
        breakdown[label] = {k: int(info[k]) for k in fields if k in info}
        breakdown[label]["keys"] = int(server.r.dbsize())
        return int(info["used_memory"])

    def top_keys(k: int = 6) -> list:
        sizes = [(int(server.r.memory_usage(key, samples=0) or 0), key.decode(errors="replace"))
                 for key in server.r.scan_iter(count=1000)]
        return [[name, size] for size, name in sorted(sizes, reverse=True)[:k]]

    def on_ready() -> dict:
        marks["before"] = snapshot("before")
        breakdown["before"]["top_keys"] = top_keys()
        return {}

    def after_done(procs: Procs) -> dict:
        marks["after_processed"] = snapshot("after_processed")
        sample()
        # wait out the window: every applied bucket expired, results trimmed (consumer trim loop, 5 s)
        t0 = time.monotonic()

        def settled() -> bool:
            k, _t, _m = applied_usage()
            return k == 0 and server.r.xlen("{" + NAMESPACE + "}:results") == 0 \
                and server.r.xlen("{" + NAMESPACE + "}:requests") == 0

        try:
            wait_for(settled, 3 * window + 30, "the de-duplication window to pass", procs=procs,
                     allow_exited=("producer",), interval=0.25)
        except BenchError as exc:
            res.details["settle_error"] = str(exc)
        marks["settle_s"] = int(time.monotonic() - t0)
        marks["after_window"] = snapshot("after_window")
        breakdown["after_window"]["top_keys"] = top_keys()
        # Redis 7 keeps a latency histogram per command type it has run (latency-tracking): a few
        # hundred KB that no key holds and CONFIG RESETSTAT frees; say how much of the growth it is
        server.r.config_resetstat()
        marks["freed_by_resetstat"] = marks["after_window"] - server.used_memory()
        return {}

    env = {"REDROLL_DEDUP_WINDOW_S": window}
    # the baseline is taken when the worker and the consumer are up (streams and groups exist), just
    # before the producer starts
    run = pipeline_run(server, run_dir, count=n, workers=[redroll_worker_argv(token_ms=0, max_inflight=256)],
                       producer=producer_argv(n, run_dir / "producer.json", chunk=1000), env=env,
                       timeout=max(120, n / 100), on_ready=on_ready, while_waiting=sample, after_done=after_done)
    before, after_p, after_w = marks["before"], marks["after_processed"], marks["after_window"]
    res.fig("used_memory_before_MB", before / MB, "MB")
    res.fig("used_memory_after_processed_MB", after_p / MB, "MB")
    res.fig("used_memory_after_window_MB", after_w / MB, "MB")
    res.fig("growth_after_window_MB", (after_w - before) / MB, "MB", target="<= 10", check=lambda v: v <= 10,
            note="used_memory after the window - before", signed=True)
    per = best["bytes"] / best["members"] if best["members"] else float("nan")
    res.fig("dedup_bytes_per_request", per, "B/request", target="<= 150", check=lambda v: v <= 150)
    res.details.update({
        "requests": n, "dedup_window_s": window, "rate_rps": round(run.rate, 1),
        "growth_after_window_bytes": after_w - before, "growth_after_processed_bytes": after_p - before,
        "peak_used_memory_MB": round(peak["used_memory"] / MB, 2), "settle_wait_s": marks.get("settle_s"),
        "freed_by_config_resetstat_bytes": marks.get("freed_by_resetstat"),
        "dedup_sample": best, "cpu_us_per_request": run.cpu_us_per_item(), "info_memory": breakdown,
        "how": "used_memory (INFO memory) with the worker and consumer up, right after the last callback, and once "
               "every {ns}:applied:* bucket expired and the consumer trimmed the results stream; dedup bytes = "
               "sum of MEMORY USAGE (SAMPLES 0) of the live applied buckets / their members, sampled every 0.5 s "
               "during the run (largest sample kept); REDROLL_DEDUP_WINDOW_S set for worker and consumer",
    })
