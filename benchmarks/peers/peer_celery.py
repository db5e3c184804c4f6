"""Celery with the Redis broker: producer -> job worker -> callback worker (the job's ``link``).

Worker:   celery -A benchmarks.peers.peer_celery worker -Q jobs -P solo ...
Consumer: celery -A benchmarks.peers.peer_celery worker -Q results -P solo ...
Producer: python -m benchmarks.peers.peer_celery --count N --out FILE

``job.apply_async((payload,), link=on_result.s())``: when the job succeeds, the worker sends
``on_result(result)`` to the ``results`` queue (Celery's callback mechanism). No result backend.
"""

from __future__ import annotations

import os
import time

from celery import Celery
from celery.signals import worker_ready

from benchmarks.peers import common

app = Celery("bench", broker=common.REDIS_URL)
app.conf.update(
    task_routes={"bench.job": {"queue": "jobs"}, "bench.on_result": {"queue": "results"}},
    task_ignore_result=True,
    worker_prefetch_multiplier=int(os.environ.get("BENCH_CELERY_PREFETCH", "64")),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@app.task(name="bench.job")
def job(payload: dict) -> dict:
    return common.generate(payload)


@app.task(name="bench.on_result")
def on_result(result: dict) -> None:
    common.count(result)


@worker_ready.connect
def _ready(sender=None, **_kw) -> None:
    queues = {q.name for q in sender.app.amqp.queues.consume_from.values()} if sender is not None else set()
    common.ready("consumer" if "results" in queues else "worker")


def produce(count: int, out: str) -> None:
    callback = on_result.s()
    with app.producer_or_acquire() as producer:
        job.apply_async((common.make_job(0),), link=callback, producer=producer)  # connect before timing
        cpu0 = time.process_time()
        t_first = time.time()
        for i in range(1, count):
            job.apply_async((common.make_job(i),), link=callback, producer=producer)
    common.report(out, t_first, count, cpu0)


if __name__ == "__main__":
    common.producer_main(produce)
