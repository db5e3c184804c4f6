"""What every peer's job and callback do (stdlib only: this runs inside the peers' virtualenvs).

The job carries the same fields as a redroll request (``request_id``, 8 ``input_ids``,
``sampling_params.max_new_tokens`` 8, ...); the worker makes 8 deterministic token ids the way
the synthetic engine does (blake2b-seeded RNG) and hands a record-shaped result (ids, finish
reasons, meta_info) to the callback hop, whose handler counts like ``bench_handlers.count``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import time
import uuid
from typing import Any, Awaitable, Callable

EXPECT = int(os.environ.get("BENCH_EXPECT", "0") or 0)
DONE_FILE = os.environ.get("BENCH_DONE_FILE", "")
READY_DIR = os.environ.get("BENCH_READY_DIR", "")
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")

_state = {"n": 0, "first": 0.0, "written": False}


CHUNK = 100
"""Jobs a producer hands over at a time, the same for every peer and for redroll's side-by-side
run (one ``gather`` of enqueues, one ``addBulk``, one ``send``)."""

_ID_PREFIX = uuid.uuid4().hex[:24]  # (each peer process is started fresh, never forked)


def make_job(i: int) -> dict:
    return {
        "v": 1,
        "request_id": f"{_ID_PREFIX}{i:08x}_{i % 7}",  # the same shape as redroll's benchmark ids
        "input_ids": [(1000 + 37 * (i + j)) % 32000 for j in range(8)],
        "sampling_params": {"max_new_tokens": 8},
        "return_logprob": False,
        "collect_unfinished": False,
        "meta_info": {},
        "reply_to": "{bench}:results",
        "callback": "h",
        "group_id": None,
        "deadline": None,
        "submitted_at": time.time(),
    }


def job_bytes() -> int:
    return len(json.dumps(make_job(0), separators=(",", ":")))


def generate(job: dict) -> dict:
    h = hashlib.blake2b(digest_size=8)
    h.update(b"ids:" + ",".join(map(str, job["input_ids"])).encode())
    h.update(f"|seed:{job['request_id']}|0".encode())
    rng = random.Random(int.from_bytes(h.digest(), "big"))
    n = job["sampling_params"]["max_new_tokens"]
    ids = [rng.randrange(32000) for _ in range(n)]
    return {
        "v": 1,
        "request_id": job["request_id"],
        "output_token_ids": [ids],
        "finish_reasons": ["length"],
        "output_logprobs": None,
        "meta_info": {"prompt_tokens": len(job["input_ids"]), "completion_tokens": n, "cached_tokens": 0,
                      "weight_version": "0", "worker": f"peer-{os.getpid()}", "attempt": 1, "queue_ms": 0.0,
                      "engine_ms": 0.0, "eos_token_id": None, "pad_token_id": None},
        "error": None,
        "callback": job["callback"],
        "group_id": None,
    }


def _write(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(obj, fh)
    os.replace(tmp, path)


def count(_result: dict) -> None:
    n = _state["n"] = _state["n"] + 1
    if n == 1:
        _state["first"] = time.time()
    if n >= EXPECT and not _state["written"]:
        _state["written"] = True
        if DONE_FILE:
            _write(DONE_FILE, {"count": n, "t_first": _state["first"], "t_last": time.time()})


def ready(role: str) -> None:
    if READY_DIR:
        _write(os.path.join(READY_DIR, f"{role}.ready"), {"pid": os.getpid()})


def report(out: str, t_first: float, count: int, cpu0: float) -> None:
    _write(out, {"t_first": t_first, "t_last": time.time(), "count": count, "cpu_s": time.process_time() - cpu0,
                 "job_bytes": job_bytes()})


async def produce_in_chunks(count: int, out: str, enqueue: Callable[[dict], Awaitable[Any]], chunk: int = CHUNK) -> None:
    """The asyncio peers' producer: ``chunk`` enqueues at once, ``count`` jobs in all, then the report."""
    cpu0 = time.process_time()
    t_first = time.time()
    sent = 0
    while sent < count:
        k = min(chunk, count - sent)
        await asyncio.gather(*(enqueue(make_job(i)) for i in range(sent, sent + k)))
        sent += k
    report(out, t_first, sent, cpu0)


def producer_main(produce: Callable[[int, str], Any]) -> None:
    """A peer's producer command line: ``--count N --out FILE``, then ``produce(N, FILE)`` (run
    with ``asyncio.run`` when it is a coroutine function)."""
    import argparse
    import inspect

    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if inspect.iscoroutinefunction(produce):
        asyncio.run(produce(a.count, a.out))
    else:
        produce(a.count, a.out)
