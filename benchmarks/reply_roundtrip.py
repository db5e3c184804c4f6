"""A producer's round trip through its reply stream, at the queue's ceiling.

    python -m benchmarks.reply_roundtrip [--requests 10000] [--chunk 500] [--runs 3]

On a private redis-server, one in-process worker on the synthetic engine (no time per token, 256
in flight) serves ``--requests`` requests that a :class:`~redroll.producer.client.Producer`
submits ``--chunk`` at a time and awaits (each record to its reply stream, applied, acked: the
path of ``submit_many``, ``finish_many`` and ``ack_replies``). Reported per run: requests per
second, redis-server's CPU (user + system) per request and its command time (``INFO
commandstats``) per request; then the median and range over the runs. Run it from two checkouts
to compare them. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

from benchmarks.stream_cost import command_usec, print_runs
from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.producer.client import Producer
from redroll.shared.settings import Settings


async def server_cpu_s(r) -> float:
    cpu = await r.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


async def one_pass(producer: Producer, count: int, chunk: int, tag: str) -> None:
    futures = []
    for start in range(0, count, chunk):
        futures += await producer.submit_many([
            {"request_id": f"{tag}-{i}", "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
            for i in range(start, min(count, start + chunk))])
    await asyncio.gather(*futures)


async def one_run(url: str, args) -> dict[str, float]:
    settings = Settings(redis_url=url, namespace="rr" + uuid.uuid4().hex[:8])
    worker = Worker(settings, SyntheticEngine(token_ms=0), max_inflight=256, block_ms=100)
    task = asyncio.create_task(worker.run())
    try:
        async with Producer(settings, block_ms=100) as producer:
            r = producer.redis
            await one_pass(producer, min(args.requests, 1000), args.chunk, "warm")
            cpu, usec, started = await server_cpu_s(r), await command_usec(r), time.perf_counter()
            await one_pass(producer, args.requests, args.chunk, "run")
            wall = time.perf_counter() - started
            cpu, usec = await server_cpu_s(r) - cpu, await command_usec(r) - usec
    finally:
        worker.request_stop()
        await task
    return {"requests_per_s": args.requests / wall, "redis_cpu_usec_per_request": cpu / args.requests * 1e6,
            "redis_command_usec_per_request": usec / args.requests}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--chunk", type=int, default=500)
    p.add_argument("--runs", type=int, default=3)
    print_runs(p.parse_args(), one_run)

if __name__ == "__main__":
    main()
