"""taskiq + taskiq-redis (RedisStreamBroker): producer -> job worker -> callback worker.

Worker:   taskiq worker benchmarks.peers.peer_taskiq:job_broker --workers 1 --max-async-tasks 256
Consumer: taskiq worker benchmarks.peers.peer_taskiq:result_broker --workers 1 --max-async-tasks 256
Producer: python -m benchmarks.peers.peer_taskiq --count N --out FILE

The job task kicks ``on_result`` (on the results stream) with its result: the callback hop.
Both consumer groups start at id 0 (taskiq's default ``$`` would skip jobs queued before a worker
joined), like redroll's.
"""

from __future__ import annotations

from taskiq import TaskiqEvents, TaskiqState
from taskiq_redis import RedisStreamBroker

from benchmarks.peers import common

job_broker = RedisStreamBroker(common.REDIS_URL, queue_name="bench:jobs", consumer_group_name="workers",
                               consumer_id="0", xread_count=256)
result_broker = RedisStreamBroker(common.REDIS_URL, queue_name="bench:results", consumer_group_name="bench",
                                  consumer_id="0", xread_count=256)


@job_broker.task(task_name="bench.job")
async def job(payload: dict) -> None:
    await on_result.kiq(common.generate(payload))


@result_broker.task(task_name="bench.on_result")
async def on_result(result: dict) -> None:
    common.count(result)


@job_broker.on_event(TaskiqEvents.WORKER_STARTUP)
async def _job_worker_up(state: TaskiqState) -> None:
    await result_broker.startup()  # the job worker kicks callbacks onto the results stream
    common.ready("worker")


@result_broker.on_event(TaskiqEvents.WORKER_STARTUP)
async def _result_worker_up(state: TaskiqState) -> None:
    common.ready("consumer")


async def produce(count: int, out: str, chunk: int = common.CHUNK) -> None:
    await job_broker.startup()
    await common.produce_in_chunks(count, out, job.kiq, chunk)
    await job_broker.shutdown()


if __name__ == "__main__":
    common.producer_main(produce)
