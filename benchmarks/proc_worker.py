"""A worker process on a benchmark engine model, or that engine driven directly.

Pipeline: builds ``redroll.engine_worker.worker.Worker(Settings.from_env(), engine, max_inflight=M)`` and
runs it until SIGTERM (graceful drain, as ``redroll worker`` does); then writes the engine's
counters to ``--stats-out``.

Direct (``--direct N``): no Redis at all; ``--concurrency`` coroutines each keep one request in
the engine at all times until N requests completed; writes elapsed time and counters.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time

from benchmarks.engines import CannedEngine, SlotEngine
from benchmarks.harness import write_json_atomic
from benchmarks.payload import make_requests
from redroll.cli.runtime import run as run_async_main


def _engine(a: argparse.Namespace):
    if a.engine == "slots":
        return SlotEngine(slots=a.slots, token_ms=a.token_ms)
    return CannedEngine()


def _stats(engine) -> dict:
    if isinstance(engine, SlotEngine):
        s = engine.stats
        return {"steps": s.steps, "busy_slot_steps": s.busy_slot_steps, "completed": s.completed,
                "occupancy": engine.occupancy, "late_s": s.late_s, "first_step": s.first_step,
                "last_step": s.last_step, "slots": engine.slots}
    return {}


async def run_direct(a: argparse.Namespace) -> dict:
    engine = _engine(a)
    await engine.start()
    reqs = list(make_requests(a.direct, max_new_tokens=a.max_new_tokens))
    it = iter(reqs)
    done = 0

    async def driver(k: int) -> None:
        nonlocal done
        for req in it:
            await engine.generate(req, f"{req.request_id}.{k}")
            done += 1

    t0 = time.time()
    await asyncio.gather(*(driver(k) for k in range(a.concurrency)))
    t1 = time.time()
    await engine.close()
    return {"t_first": t0, "t_last": t1, "count": done, **_stats(engine)}


async def run_pipeline(a: argparse.Namespace) -> dict:
    from redroll.engine_worker.worker import Worker
    from redroll.shared.settings import Settings

    engine = _engine(a)
    worker = Worker(Settings.from_env(), engine, max_inflight=a.max_inflight)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.request_stop)
    await worker.run()
    return {**_stats(engine), "published": worker.stats.published}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["slots", "canned"], default="slots")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--token-ms", type=float, default=10.0)
    ap.add_argument("--max-inflight", type=int, default=64)
    ap.add_argument("--direct", type=int, default=0, help="drive the engine directly with this many requests")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--stats-out", default=None)
    a = ap.parse_args()
    out = run_async_main(run_direct(a) if a.direct else run_pipeline(a))
    if a.stats_out:
        write_json_atomic(a.stats_out, out)


if __name__ == "__main__":
    main()
