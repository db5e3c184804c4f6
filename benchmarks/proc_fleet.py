"""A process hosting ``--workers`` redroll workers (synthetic engine), one asyncio loop, until SIGTERM.

Each is a full ``redroll.engine_worker.worker.Worker`` with the default block, claim-idle and
heartbeat settings (from ``REDROLL_*``), its own name, engine and connection pool: to Redis it is
what ``--workers`` separate ``redroll worker`` processes would be. The fleet bench
(``benchmarks/fleet.py``) spreads a fleet over a few such processes, since 64 interpreters would
not fit a small machine's memory and CPU, while the Redis load is the same.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from redroll.cli.runtime import run as run_async_main


async def main(count: int, token_ms: float, max_inflight: int) -> None:
    from redroll.engine_worker.engines.synthetic import SyntheticEngine
    from redroll.engine_worker.worker import Worker
    from redroll.shared.settings import Settings

    settings = Settings.from_env()
    workers = [Worker(settings, SyntheticEngine(token_ms=token_ms), max_inflight=max_inflight) for _ in range(count)]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: [w.request_stop() for w in workers])
    await asyncio.gather(*(w.run() for w in workers))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, required=True)
    ap.add_argument("--token-ms", type=float, default=0.0)
    ap.add_argument("--max-inflight", type=int, default=256)
    a = ap.parse_args()
    run_async_main(main(a.workers, a.token_ms, a.max_inflight))
