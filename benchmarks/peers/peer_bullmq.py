"""BullMQ (its Python port): producer -> job worker -> ``QueueEvents`` collector of the ``completed`` events.

Worker:   python -m benchmarks.peers.peer_bullmq worker
Consumer: python -m benchmarks.peers.peer_bullmq consumer
Producer: python -m benchmarks.peers.peer_bullmq producer --count N --out FILE

The producer adds the jobs with ``Queue.addBulk``, ``common.CHUNK`` (100) a call, each call one
MULTI of ``addStandardJob`` scripts. The worker's processor returns the record-shaped result;
BullMQ stores it as the job's ``returnvalue`` and publishes it in the queue's ``completed`` event,
which ``QueueEvents`` (BullMQ's way to get results) reads and JSON-decodes for the collector: the
callback hop.

Tuned for throughput: ``Worker`` concurrency 100 (default 1); ``removeOnComplete`` on every job (the
result travels in the event, nothing reads the job afterwards, so neither job hashes nor the completed
set grow); ``QueueEvents`` from id 0 (its default ``$`` misses events published before its first XREAD;
the stream is new each run); the events stream's length cap raised to 100,000 (default 10,000, about
4 events a job, approximate trim) so no unread ``completed`` event is trimmed away. The Python port has
no ``streams.events.maxLen`` queue option as Node's has, so the producer sets the queue's meta field
``opts.maxLenEvents`` that the Lua scripts read.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from bullmq import Queue, QueueEvents, Worker

from benchmarks.peers import common

JOBS = "bench-jobs"
CONNECTION = {"connection": common.REDIS_URL}
MAX_EVENTS = 100_000


async def process(job, token: str) -> dict:
    return common.generate(job.data)


def on_completed(args: dict, _entry_id: str) -> None:
    result = args.get("returnvalue")  # QueueEvents has JSON-decoded it
    if not isinstance(result, dict) or not result.get("output_token_ids"):
        raise RuntimeError(f"job {args.get('jobId')}: unexpected returnvalue {result!r:.200}")
    common.count(result)


async def work() -> None:
    worker = Worker(JOBS, process, {**CONNECTION, "concurrency": 100})
    worker.on("failed", lambda job, err: print(f"job {job.id} failed: {err!r}", file=sys.stderr, flush=True))
    worker.on("error", lambda err, *_: print(f"worker error: {err!r}", file=sys.stderr, flush=True))
    while not worker.drained:  # it has looked at the queue once: it is polling
        await asyncio.sleep(0.01)
    common.ready("worker")
    await asyncio.Event().wait()


async def collect() -> None:
    events = QueueEvents(JOBS, {**CONNECTION, "lastEventId": "0", "autorun": False})
    events.on("completed", on_completed)
    await events.client.ping()
    common.ready("consumer")
    await events.run()


async def produce(count: int, out: str, chunk: int = common.CHUNK) -> None:
    queue = Queue(JOBS, {**CONNECTION, "defaultJobOptions": {"removeOnComplete": True}})
    await queue.client.hset(queue.keys["meta"], "opts.maxLenEvents", MAX_EVENTS)  # (connects before timing)
    cpu0 = time.process_time()
    t_first = time.time()
    for start in range(0, count, chunk):
        jobs = [{"name": "job", "data": common.make_job(i)} for i in range(start, min(count, start + chunk))]
        await queue.addBulk(jobs)
    common.report(out, t_first, count, cpu0)
    await queue.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=("worker", "consumer", "producer"))
    ap.add_argument("--count", type=int, default=0)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    roles = {"worker": work, "consumer": collect, "producer": lambda: produce(a.count, a.out)}
    asyncio.run(roles[a.role]())
