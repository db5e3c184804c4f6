"""arq: producer -> job worker -> callback worker (the job enqueues ``on_result`` on a second queue).

Worker:   arq benchmarks.peers.peer_arq.JobWorker
Consumer: arq benchmarks.peers.peer_arq.ResultWorker
Producer: python -m benchmarks.peers.peer_arq --count N --out FILE

Tuned for throughput: ``max_jobs`` 256 (default 10), ``poll_delay`` 10 ms (default 0.5 s),
``keep_result`` 0 (the result travels to the callback; nothing waits on it).
"""

from __future__ import annotations

from arq import create_pool
from arq.connections import RedisSettings

from benchmarks.peers import common

REDIS = RedisSettings.from_dsn(common.REDIS_URL)
JOBS, RESULTS = "bench:jobs", "bench:results"


async def job(ctx: dict, payload: dict) -> None:
    await ctx["redis"].enqueue_job("on_result", common.generate(payload), _queue_name=RESULTS)


async def on_result(ctx: dict, result: dict) -> None:
    common.count(result)


async def _worker_up(ctx: dict) -> None:
    common.ready("worker")


async def _consumer_up(ctx: dict) -> None:
    common.ready("consumer")


class JobWorker:
    functions = [job]
    queue_name = JOBS
    redis_settings = REDIS
    max_jobs = 256
    poll_delay = 0.01
    keep_result = 0
    on_startup = _worker_up


class ResultWorker:
    functions = [on_result]
    queue_name = RESULTS
    redis_settings = REDIS
    max_jobs = 256
    poll_delay = 0.01
    keep_result = 0
    on_startup = _consumer_up


async def produce(count: int, out: str, chunk: int = common.CHUNK) -> None:
    pool = await create_pool(REDIS, default_queue_name=JOBS)
    await common.produce_in_chunks(count, out, lambda payload: pool.enqueue_job("job", payload), chunk)
    await pool.aclose()


if __name__ == "__main__":
    common.producer_main(produce)
