"""redroll as a user runs it, beside the peers: a producer script -> ``redroll worker`` -> ``redroll consume``.

Producer: python -m benchmarks.peers.peer_redroll --count N --out FILE

What a user's own script does: ``asyncio.run`` (no event-loop or garbage-collector tuning of its
own), each job made into a request with the public ``make_request`` from the same job dict every
peer's producer enqueues (``common.make_job``: its fields, a fresh sampling-params dict each),
handed over ``common.CHUNK`` (100) at a time with the public fire-and-forget ``send``, records to
the results stream. The worker and the consumer are the command lines a user starts:
``redroll worker --engine synthetic --max-inflight 256`` (the synthetic engine declares no
capacity, so without the flag a worker holds 32 at a time; each peer's worker is given its
throughput setting likewise: BullMQ concurrency 100, taskiq and arq 256) and ``redroll consume
--group bench --handler h=benchmarks.peers.common:count`` (the same counting callback the peers'
collectors run).
"""

from __future__ import annotations

import argparse
import asyncio
import time

from benchmarks.peers import common

REQUEST_FIELDS = ("request_id", "input_ids", "sampling_params", "return_logprob", "collect_unfinished",
                  "meta_info", "callback", "group_id", "deadline")
"""The job's fields a redroll request takes (its ``reply_to`` is the results stream, set by ``send``)."""


async def produce(count: int, out: str, chunk: int = common.CHUNK) -> None:
    from redis.asyncio import Redis

    from redroll import Settings, make_request, send

    settings = Settings.from_env()
    client = Redis.from_url(settings.redis_url)
    await client.ping()  # (connected before the clock starts, as every peer's producer is)
    cpu0 = time.process_time()
    t_first = time.time()
    for start in range(0, count, chunk):
        jobs = [common.make_job(i) for i in range(start, min(count, start + chunk))]
        await send(settings, client, [make_request(**{k: job[k] for k in REQUEST_FIELDS}) for job in jobs])
    common.report(out, t_first, count, cpu0)
    await client.aclose()


def worker_argv(py: str) -> list[str]:
    return [py, "-m", "redroll.cli", "worker", "--engine", "synthetic", "--max-inflight", "256"]


def consumer_argv(py: str) -> list[str]:
    return [py, "-m", "redroll.cli", "consume", "--group", "bench", "--handler", "h=benchmarks.peers.common:count"]


if __name__ == "__main__":
    # (written out, not common.producer_main: this file is the script a user writes, asyncio.run and all)
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    asyncio.run(produce(a.count, a.out))
