"""What periodic checkpoints cost at the default interval: the same long generations with
continuation on (every request saved every ``checkpoint_tokens`` tokens and ``checkpoint_interval_s``
seconds, whichever later) and off, in paired runs.

    python -m benchmarks.checkpoint_cost [--requests 128] [--tokens 2000] [--token-ms 10] [--pairs 3]

On a private redis-server, one in-process worker on the synthetic engine (``--token-ms`` a token)
serves ``--requests`` text-prompt requests of ``--tokens`` tokens, all submitted at once, once
with ``continuation`` off and once on (the order alternates between pairs). Reported per pass:
throughput (output tokens a second, submit to the last record), redis-server's CPU (user + system)
and this process's CPU (worker, producer and client: the worker's share is the difference between
the passes), and the checkpoints written; per pair the throughput ratio on / off and the extra
Redis and process CPU per token; then the median and range over the pairs. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid

from benchmarks.harness import median_range
from benchmarks.stream_cost import server_cpu_usec
from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.producer.client import Producer
from redroll.shared.settings import Settings
from redroll.testing.embedded import start_redis_server


async def one_pass(url: str, args: argparse.Namespace, continuation: bool) -> dict[str, float]:
    settings = Settings(redis_url=url, namespace="cc" + uuid.uuid4().hex[:8], continuation=continuation)
    worker = Worker(settings, SyntheticEngine(token_ms=args.token_ms), max_inflight=args.requests, block_ms=100)
    task = asyncio.create_task(worker.run())
    try:
        async with Producer(settings, block_ms=100) as producer:
            r = producer.redis
            await asyncio.gather(*(producer.generate(request_id=f"w-{i}", prompt="x", timeout=600,
                                                     sampling_params={"max_new_tokens": 4}) for i in range(8)))
            sp = {"max_new_tokens": args.tokens, "ignore_eos": True}
            cpu, mine, started = await server_cpu_usec(r), time.process_time(), time.perf_counter()
            records = await asyncio.gather(*(producer.generate(request_id=f"g-{i}", prompt="x", sampling_params=sp,
                                                               timeout=600) for i in range(args.requests)))
            wall = time.perf_counter() - started
            cpu, mine = await server_cpu_usec(r) - cpu, (time.process_time() - mine) * 1e6
    finally:
        worker.request_stop()
        await task
    tokens = sum(len(rec.output_token_ids[0]) for rec in records)
    return {"tokens_per_s": tokens / wall, "redis_cpu_usec_per_token": cpu / tokens,
            "process_cpu_usec_per_token": mine / tokens, "checkpoints": worker.stats.checkpoints,
            "tokens_per_checkpoint": tokens / worker.stats.checkpoints if worker.stats.checkpoints else 0.0}


async def one_pair(url: str, args: argparse.Namespace, on_first: bool) -> dict[str, float]:
    order = (True, False) if on_first else (False, True)
    passes = {c: await one_pass(url, args, c) for c in order}
    on, off = passes[True], passes[False]
    return {"throughput_on_over_off": on["tokens_per_s"] / off["tokens_per_s"],
            "tokens_per_s_on": on["tokens_per_s"], "tokens_per_s_off": off["tokens_per_s"],
            "extra_redis_cpu_usec_per_token": on["redis_cpu_usec_per_token"] - off["redis_cpu_usec_per_token"],
            "extra_process_cpu_usec_per_token": on["process_cpu_usec_per_token"] - off["process_cpu_usec_per_token"],
            "redis_cpu_usec_per_token_off": off["redis_cpu_usec_per_token"],
            "checkpoints": on["checkpoints"], "tokens_per_checkpoint": on["tokens_per_checkpoint"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--token-ms", type=float, default=10.0)
    p.add_argument("--pairs", type=int, default=3)
    args = p.parse_args()
    server = start_redis_server()
    try:
        pairs = [asyncio.run(one_pair(server.url, args, i % 2 == 0)) for i in range(args.pairs)]
    finally:
        server.stop()
    print(json.dumps({"args": vars(args), "pairs": pairs, "summary": median_range(pairs)}, indent=1))


if __name__ == "__main__":
    main()
