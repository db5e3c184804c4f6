"""The capacity model held to a measurement, and the per-chunk and per-checkpoint constants it uses.

    python -m benchmarks.capacity_check [--workers 64] [--per-worker 2] [--tokens 64] [--token-ms 30]
                                        [--seconds 20] [--runs 3] [--json-out FILE]
    python -m benchmarks.capacity_check --measure [--runs 3] [--json-out FILE]

Check (default): ``--workers`` synthetic workers (``--token-ms`` per token, ``--per-worker``
requests each at once: a stand-in for GPUs) in 8 host processes (``benchmarks/proc_fleet.py``),
fed by a producer process that keeps ``workers x per-worker`` streamed requests of ``--tokens``
tokens going, reading every chunk (``Producer.stream``; settings at their defaults: chunks every 8
tokens or 50 ms, checkpoints at their defaults). Over ``--seconds`` of that steady state it
measures redis-server's CPU (``INFO cpu``), the tokens and requests per second the workers made
(their heartbeats' counters) and the chunks written, then asks the model
(:func:`redroll.ops.capacity.redis_share`) what Redis CPU that workload costs, with the measured
tokens/s per worker, and prints both: the model's prediction over the measurement.

Measure (``--measure``): the constants the model takes, from a steady state of another shape
(64 workers, 4 requests each at once, 15 ms a token, 96-token requests: other chunk sizes, other
request lengths, as many writes a second): an empty server's own CPU, then the workers idle
(``idle_worker_us``: Redis CPU a second per worker), with awaited requests (``request_us``: Redis
CPU per request over the idle fleet's, ``Producer.generate``), and streamed twice, 4 and 1
requests a worker (as many writes, four times the chunks: ``chunk_us`` per chunk and
``chunk_call_us`` per write, what is left once the requests are paid). Redis's CPU per command falls as it gets
busier (it serves more clients per wake of its event loop), so constants measured at a tenth of a
core overstate what a busy primary spends: the GPU counts they give err low.

On a shared machine compare the check's two figures within one run; the runs' spread says how
much the machine moved.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.fleet import WORKERS_KEY, provision
from benchmarks.harness import (
    Procs,
    Server,
    emit_json,
    make_base_dir,
    median_range,
    new_run_dir,
    raise_fd_limit,
    redroll_env,
    wait_for,
)
from benchmarks.runs import PY

NAMESPACE = "bench"


# ---------------------------------------------------------------- the load (a process of its own)


async def load(streams: int, tokens: int, seconds: float, out: str, streamed: bool) -> None:
    """Keep ``streams`` requests going for ``seconds`` (each followed by another), streamed (every
    chunk read) or awaited; the counts so far go to ``out`` every half second."""
    from redroll.producer.client import Producer
    from redroll.shared.settings import Settings

    settings = Settings.from_env()
    counts = {"requests": 0, "chunks": 0, "tokens": 0}
    stop_at = time.monotonic() + seconds
    sp = {"max_new_tokens": tokens, "ignore_eos": True}

    async def one(k: int) -> None:
        while time.monotonic() < stop_at:
            rid = f"c{k}-{uuid.uuid4().hex[:12]}"
            if streamed:
                async for chunk in producer.stream(request_id=rid, prompt="x", sampling_params=sp, timeout=600):
                    counts["chunks"] += 1
                    counts["tokens"] += len(chunk.token_ids)
            else:
                await producer.generate(request_id=rid, prompt="x", sampling_params=sp, timeout=600)
            counts["requests"] += 1

    async def report() -> None:
        while time.monotonic() < stop_at + 5:
            Path(out + ".tmp").write_text(json.dumps({**counts, "at": time.time()}))
            os.replace(out + ".tmp", out)
            await asyncio.sleep(0.5)

    async with Producer(settings) as producer:
        reporter = asyncio.create_task(report())
        await asyncio.gather(*(one(k) for k in range(streams)))
        reporter.cancel()


# ---------------------------------------------------------------- a steady state, measured


def beats(server: Server) -> dict[str, dict[str, Any]]:
    return {k.decode(): json.loads(v) for k, v in server.r.hgetall(WORKERS_KEY).items()}


def _counts(path: Path) -> dict[str, float]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"requests": 0, "chunks": 0, "tokens": 0}


def steady(server: Server, run_dir: Path, a: argparse.Namespace, workers: int, mode: str, *, per_worker: int,
           token_ms: float, tokens: int) -> dict[str, Any]:
    """``workers`` synthetic workers (8 host processes at most; ``token_ms`` a token, ``per_worker``
    requests each at once), and the load of ``mode`` (idle, awaited or streamed: requests of
    ``tokens`` tokens) kept up by a producer process: Redis CPU and the work done over
    ``a.seconds`` once ``a.warmup_s`` passed."""
    server.fresh()
    provision(server, workers)
    run_dir.mkdir(parents=True, exist_ok=True)
    env = redroll_env(server, NAMESPACE)
    processes = min(8, workers)
    counts = [workers // processes + (1 if i < workers % processes else 0) for i in range(processes)]
    streams = workers * per_worker
    with Procs(run_dir) as procs:
        for i, n in enumerate(counts):
            procs.spawn(f"host{i}", [PY, "-m", "benchmarks.proc_fleet", "--workers", str(n), "--token-ms",
                                     str(token_ms), "--max-inflight", str(per_worker)], env)
        wait_for(lambda: server.r.hlen(WORKERS_KEY) >= workers, 300, f"{workers} workers", procs=procs)
        out = run_dir / "load.json"
        if mode != "idle":
            procs.spawn("load", [PY, "-m", "benchmarks.capacity_check", "--load", str(streams), "--load-mode", mode,
                                 "--tokens", str(tokens), "--seconds", str(a.warmup_s + a.seconds + 5),
                                 "--load-out", str(out)], env)
        time.sleep(a.warmup_s)
        b0, l0, r0, t0 = beats(server), _counts(out), server.cpu_s(), time.monotonic()
        time.sleep(a.seconds)
        b1, l1, r1, t1 = beats(server), _counts(out), server.cpu_s(), time.monotonic()
        procs.check_alive(allow_exited=("load",))
    elapsed = t1 - t0
    tokens = sum(b1[w]["tokens"] - b0.get(w, {}).get("tokens", 0) for w in b1) / elapsed
    return {"mode": mode, "workers": workers, "streams": streams if mode != "idle" else 0, "seconds": round(elapsed, 1),
            "redis_share": round((r1 - r0) / elapsed, 5), "tokens_per_s": round(tokens, 1),
            "requests_per_s": round((l1["requests"] - l0["requests"]) / elapsed, 2),
            "chunks_per_s": round((l1["chunks"] - l0["chunks"]) / elapsed, 1)}


def empty_share(server: Server, seconds: float) -> float:
    """An empty redis-server's own CPU (its timers), a share of one core."""
    server.fresh()
    r0, t0 = server.cpu_s(), time.monotonic()
    time.sleep(seconds)
    return (server.cpu_s() - r0) / (time.monotonic() - t0)


def check(server: Server, run_dir: Path, a: argparse.Namespace) -> dict[str, Any]:
    from redroll.ops.capacity import Workload, redis_share

    base = empty_share(server, 3.0)
    got = steady(server, run_dir, a, a.workers, "streamed", per_worker=a.per_worker, token_ms=a.token_ms,
                 tokens=a.tokens)
    per_worker_tps = got["tokens_per_s"] / a.workers
    workload = Workload(tokens_per_s=per_worker_tps, completion_tokens=a.tokens, concurrency=a.per_worker,
                        stream=True)
    predicted = redis_share(workload, a.workers) + base
    return {**got, "empty_server_share": round(base, 5), "tokens_per_s_per_worker": round(per_worker_tps, 2),
            "predicted_redis_share": round(predicted, 5),
            "predicted_over_measured": round(predicted / got["redis_share"], 3) if got["redis_share"] else None}


def measure(server: Server, run_dir: Path, a: argparse.Namespace) -> dict[str, Any]:
    """The constants, from the same kind of steady state at ``a.measure_workers`` workers: idle,
    awaited, and streamed twice (``a.measure_per_worker`` requests a worker, then 1, or 2 when that
    is 1: as many writes, other numbers of chunks in them, so a write's cost and a chunk's come apart)."""
    from redroll.ops.capacity import Workload, chunk_writes_per_s

    base = empty_share(server, 3.0)
    shape = dict(per_worker=a.measure_per_worker, token_ms=a.measure_token_ms, tokens=a.measure_tokens)
    idle = steady(server, run_dir / "idle", a, a.measure_workers, "idle", **shape)
    awaited = steady(server, run_dir / "awaited", a, a.measure_workers, "awaited", **shape)
    streamed = steady(server, run_dir / "streamed", a, a.measure_workers, "streamed", **shape)
    fewer = 1 if a.measure_per_worker > 1 else 2
    single = steady(server, run_dir / "streamed-other", a, a.measure_workers, "streamed",
                    **{**shape, "per_worker": fewer})
    idle_us = max(0.0, idle["redis_share"] - base) * 1e6 / a.measure_workers
    fixed = idle["redis_share"]
    request_us = (awaited["redis_share"] - fixed) * 1e6 / awaited["requests_per_s"]
    per_run = []
    for run, per_worker in ((streamed, a.measure_per_worker), (single, fewer)):
        chunk_work = (run["redis_share"] - fixed) * 1e6 - run["requests_per_s"] * request_us
        per_chunk = run["tokens_per_s"] / run["chunks_per_s"]
        extra_ms = 1000 * per_chunk / (run["tokens_per_s"] / run["streams"]) - a.stream_chunk_ms
        load = Workload(tokens_per_s=run["tokens_per_s"] / a.measure_workers, completion_tokens=a.measure_tokens,
                        concurrency=per_worker, stream=True)
        writes = a.measure_workers * chunk_writes_per_s(load, per_chunk, extra_ms)
        per_run.append((chunk_work, run["chunks_per_s"], writes, per_chunk, extra_ms))
    (u_a, k_a, w_a, per_chunk, extra_ms), (u_b, k_b, w_b, _, _) = per_run
    chunk_us = (u_a * w_b - u_b * w_a) / (k_a * w_b - k_b * w_a)
    call_us = (u_a - k_a * chunk_us) / w_a
    return {"empty_server_share": round(base, 5), "idle_worker_us": round(idle_us, 1),
            "request_us": round(request_us, 1), "chunk_us": round(chunk_us, 1), "chunk_call_us": round(call_us, 1),
            "chunk_writes_per_s": round(w_a, 1), "tokens_per_chunk": round(per_chunk, 2),
            "chunk_timer_extra_ms": round(extra_ms, 1),
            "idle": idle, "awaited": awaited, "streamed": streamed, "streamed_other": single}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return median_range(runs, [k for k, v in runs[0].items() if isinstance(v, (int, float))])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.capacity_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--per-worker", type=int, default=2, help="streamed requests each worker runs at once")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per streamed request")
    ap.add_argument("--token-ms", type=float, default=30.0, help="the synthetic engine's time per token")
    ap.add_argument("--seconds", type=float, default=20.0, help="the measured window")
    ap.add_argument("--warmup-s", type=float, default=6.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--stream-chunk-ms", type=float, default=50.0, help=argparse.SUPPRESS)
    ap.add_argument("--measure", action="store_true", help="measure the constants instead")
    ap.add_argument("--measure-workers", type=int, default=64, help="--measure: workers")
    ap.add_argument("--measure-per-worker", type=int, default=4, help="--measure: requests each worker runs at once")
    ap.add_argument("--measure-token-ms", type=float, default=15.0, help="--measure: time per token")
    ap.add_argument("--measure-tokens", type=int, default=96, help="--measure: tokens per request")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--load", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--load-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--load-mode", default="streamed", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.load:
        from redroll.cli.runtime import run as run_async_main

        run_async_main(load(a.load, a.tokens, a.seconds, a.load_out, a.load_mode == "streamed"))
        return 0
    raise_fd_limit()
    server = Server()
    load_start = [round(x, 2) for x in os.getloadavg()]
    try:
        base = make_base_dir()
        runs = []
        for k in range(a.runs):
            if a.measure:
                runs.append(measure(server, new_run_dir(base, f"measure-{k}"), a))
                print(f"  capacity: run {k + 1}/{a.runs}: " + ", ".join(
                    f"{name} {runs[-1][name]:g}" for name in ("request_us", "chunk_us", "chunk_call_us",
                                                              "idle_worker_us", "chunk_timer_extra_ms")),
                    file=sys.stderr, flush=True)
            else:
                runs.append(check(server, new_run_dir(base, f"check-{k}"), a))
                print(f"  capacity: run {k + 1}/{a.runs}: measured {100 * runs[-1]['redis_share']:.2f}%, "
                      f"predicted {100 * runs[-1]['predicted_redis_share']:.2f}% of a core", file=sys.stderr,
                      flush=True)
    finally:
        server.stop()
    emit_json({"suite": "redroll-capacity-check", "mode": "measure" if a.measure else "check",
               "args": {k: v for k, v in vars(a).items() if k not in ("load", "load_out", "json_out")},
               "loadavg_at_start": load_start, "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
               "runs": runs, "summary": _summary(runs)}, a.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
