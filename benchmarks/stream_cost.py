"""What streaming costs: the same requests streamed and not, side by side.

    python -m benchmarks.stream_cost [--requests 200] [--tokens 64] [--chunk-tokens 8] [--runs 3]

On a private redis-server, one in-process worker on the synthetic engine (``--token-ms`` per
token, so chunks really come while a request runs) serves ``--requests`` requests of
``--tokens`` tokens, all submitted at once, twice per run: plain (``Producer.generate``) and
streamed (``Producer.stream``, every chunk read). Reported per run: the wall time of each, the
chunks written, and the Redis command time (``INFO commandstats``: usec) per request of each and
per chunk (the difference over the chunks); then the median and range over the runs. Not part of
the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from typing import Awaitable, Callable

from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.producer.client import Producer
from redroll.shared.settings import Settings
from redroll.testing.embedded import start_redis_server


async def command_usec(r) -> float:
    stats = await r.info("commandstats")
    return sum(float(v.get("usec", 0)) for v in stats.values() if isinstance(v, dict))


async def one_pass(producer: Producer, r, args, streamed: bool) -> dict[str, float]:
    sp = {"max_new_tokens": args.tokens, "ignore_eos": True}
    tag = uuid.uuid4().hex[:6]
    before, started = await command_usec(r), time.perf_counter()
    chunks = 0

    async def one(i: int) -> None:
        nonlocal chunks
        if streamed:
            async for _ in producer.stream(request_id=f"s-{tag}-{i}", prompt="x", sampling_params=sp, timeout=600):
                chunks += 1
        else:
            await producer.generate(request_id=f"p-{tag}-{i}", prompt="x", sampling_params=sp, timeout=600)

    await asyncio.gather(*(one(i) for i in range(args.requests)))
    wall = time.perf_counter() - started
    return {"wall_s": wall, "redis_usec": await command_usec(r) - before, "chunks": chunks}


async def one_run(url: str, args) -> dict[str, float]:
    settings = Settings(redis_url=url, namespace="sc" + uuid.uuid4().hex[:8], stream_chunk_tokens=args.chunk_tokens,
                        stream_chunk_ms=args.chunk_ms)
    worker = Worker(settings, SyntheticEngine(token_ms=args.token_ms), max_inflight=args.requests, block_ms=100)
    task = asyncio.create_task(worker.run())
    try:
        async with Producer(settings, block_ms=100) as producer:
            r = producer.redis
            await one_pass(producer, r, args, False)  # warm-up
            plain = await one_pass(producer, r, args, False)
            streamed = await one_pass(producer, r, args, True)
    finally:
        worker.request_stop()
        await task
    written = streamed["chunks"] - args.requests  # (each stream's last chunk comes from its record)
    return {"plain_wall_s": plain["wall_s"], "streamed_wall_s": streamed["wall_s"],
            "chunks_written": written,
            "plain_redis_usec_per_request": plain["redis_usec"] / args.requests,
            "streamed_redis_usec_per_request": streamed["redis_usec"] / args.requests,
            "redis_usec_per_chunk": (streamed["redis_usec"] - plain["redis_usec"]) / max(1, written)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--chunk-tokens", type=int, default=8)
    p.add_argument("--chunk-ms", type=float, default=50.0)
    p.add_argument("--token-ms", type=float, default=2.0)
    p.add_argument("--runs", type=int, default=3)
    print_runs(p.parse_args(), one_run)


def print_runs(args: argparse.Namespace, one_run: Callable[[str, argparse.Namespace], Awaitable[dict]]) -> None:
    """``args.runs`` runs of ``one_run(url, args)`` on one private redis-server, printed as JSON
    with each figure's median and range."""
    server = start_redis_server()
    try:
        runs = [asyncio.run(one_run(server.url, args)) for _ in range(args.runs)]
    finally:
        server.stop()
    summary = {k: {"median": statistics.median(r[k] for r in runs), "min": min(r[k] for r in runs),
                   "max": max(r[k] for r in runs)} for k in runs[0]}
    print(json.dumps({"args": vars(args), "runs": runs, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
