"""The raw redis-py three-hop ceiling: the least work that moves the same bytes the same way.

- ``producer``: pipelined ``XADD`` of request entries (``rid``, ``reply_to``, ``data``: the same
  bytes a redroll producer writes), ``--chunk`` per round trip.
- ``worker``: ``XREADGROUP COUNT --batch`` on the request stream (group ``workers``), then one
  pipeline: ``XADD`` a result entry per request (``rid``, ``status``, ``worker``, ``data``: the same
  size as a redroll record of that request) and one ``XACK`` for the batch. No decoding.
- ``consumer``: ``XREADGROUP COUNT --batch`` on the result stream (group ``bench``), ``XACK``.

``--mode sync`` uses ``redis.Redis``; ``--mode async`` uses ``redis.asyncio.Redis`` (one
coroutine, same batching). Each role stops after ``--count`` entries and writes a JSON file with
its first and last timestamps.

``--rate R`` (async only): the latency floor of the same three hops. The producer sends one entry
per round trip, paced at R per second on an absolute schedule, each stamped (field ``t``) with
``time.time()`` just before its ``XADD``; the worker copies ``t`` into the result entry; the
consumer's report adds ``samples_ms``: its read time minus ``t`` for each entry. After each read the
consumer also makes one more round trip before its ``XACK``, an ``SMISMEMBER`` of the read's rids on
a set, as a redroll consumer checks its markers before any callback runs: ``check_ms`` has its time
for each entry, so ``samples_ms[i] + check_ms[i]`` is the floor of a path that keeps that check.
Every role runs on the event loop redroll's own processes use (:func:`redroll.cli.runtime.run`).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import redis
import redis.asyncio

from benchmarks.harness import write_json_atomic
from benchmarks.payload import sample_record_fields, sample_request_fields
from redroll.cli.runtime import run as run_on_redroll_loop
from redroll.shared.keys import Keys

GROUP_W = "workers"
GROUP_C = "bench"


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["producer", "worker", "consumer"], required=True)
    ap.add_argument("--mode", choices=["sync", "async"], default="sync")
    ap.add_argument("--url", required=True)
    ap.add_argument("--namespace", default="raw")
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--chunk", type=int, default=500)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rate", type=float, default=0.0)
    ap.add_argument("--out", required=True)
    return ap.parse_args()


def run_sync(a: argparse.Namespace) -> dict:
    keys = Keys(a.namespace)
    r = redis.Redis.from_url(a.url)
    r.ping()
    cpu0 = time.process_time()
    name = f"{a.role}-raw"
    done = 0
    t_first = None
    if a.role == "producer":
        f = sample_request_fields(a.namespace)
        t_first = time.time()
        while done < a.count:
            k = min(a.chunk, a.count - done)
            pipe = r.pipeline(transaction=False)
            for i in range(done, done + k):
                pipe.xadd(keys.requests, {"rid": f"{i:032x}_0", "reply_to": f["reply_to"], "data": f["data"]})
            pipe.execute()
            done += k
    elif a.role == "worker":
        rec = sample_record_fields(a.namespace)
        while done < a.count:
            resp = r.xreadgroup(GROUP_W, name, {keys.requests: ">"}, count=a.batch, block=1000)
            entries = [e for _s, es in resp or [] for e in es]
            if not entries:
                continue
            if t_first is None:
                t_first = time.time()
            pipe = r.pipeline(transaction=False)
            for _eid, fields in entries:
                pipe.xadd(keys.results, {"rid": fields[b"rid"], "status": rec["status"], "worker": rec["worker"],
                                         "data": rec["data"]})
            pipe.xack(keys.requests, GROUP_W, *[eid for eid, _ in entries])
            pipe.execute()
            done += len(entries)
    else:
        while done < a.count:
            resp = r.xreadgroup(GROUP_C, name, {keys.results: ">"}, count=a.batch, block=1000)
            entries = [e for _s, es in resp or [] for e in es]
            if not entries:
                continue
            if t_first is None:
                t_first = time.time()
            r.xack(keys.results, GROUP_C, *[eid for eid, _ in entries])
            done += len(entries)
    out = {"t_first": t_first, "t_last": time.time(), "count": done, "cpu_s": time.process_time() - cpu0}
    r.close()
    return out


async def run_async(a: argparse.Namespace) -> dict:
    keys = Keys(a.namespace)
    r = redis.asyncio.Redis.from_url(a.url)
    await r.ping()
    cpu0 = time.process_time()
    name = f"{a.role}-raw"
    done = 0
    t_first = None
    samples: list[float] = []
    checks: list[float] = []
    if a.role == "producer" and a.rate > 0:
        f = sample_request_fields(a.namespace)
        loop = asyncio.get_running_loop()
        start = loop.time()
        t_first = time.time()
        while done < a.count:
            delay = start + done / a.rate - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await r.xadd(keys.requests, {"rid": f"{done:032x}_0", "reply_to": f["reply_to"], "data": f["data"],
                                         "t": repr(time.time())})
            done += 1
    elif a.role == "producer":
        f = sample_request_fields(a.namespace)
        t_first = time.time()
        while done < a.count:
            k = min(a.chunk, a.count - done)
            async with r.pipeline(transaction=False) as pipe:
                for i in range(done, done + k):
                    pipe.xadd(keys.requests, {"rid": f"{i:032x}_0", "reply_to": f["reply_to"], "data": f["data"]})
                await pipe.execute()
            done += k
    elif a.role == "worker":
        rec = sample_record_fields(a.namespace)
        while done < a.count:
            resp = await r.xreadgroup(GROUP_W, name, {keys.requests: ">"}, count=a.batch, block=1000)
            entries = [e for _s, es in resp or [] for e in es]
            if not entries:
                continue
            if t_first is None:
                t_first = time.time()
            async with r.pipeline(transaction=False) as pipe:
                for _eid, fields in entries:
                    out = {"rid": fields[b"rid"], "status": rec["status"], "worker": rec["worker"], "data": rec["data"]}
                    if b"t" in fields:
                        out["t"] = fields[b"t"]
                    pipe.xadd(keys.results, out)
                pipe.xack(keys.requests, GROUP_W, *[eid for eid, _ in entries])
                await pipe.execute()
            done += len(entries)
    else:
        applied = "{" + a.namespace + "}:applied:" + GROUP_C
        while done < a.count:
            resp = await r.xreadgroup(GROUP_C, name, {keys.results: ">"}, count=a.batch, block=1000)
            entries = [e for _s, es in resp or [] for e in es]
            if not entries:
                continue
            now = time.time()
            if t_first is None:
                t_first = now
            stamped = [fields for _eid, fields in entries if b"t" in fields]
            if stamped:
                samples.extend((now - float(fields[b"t"])) * 1000.0 for fields in stamped)
                started = time.perf_counter()
                await r.smismember(applied, [fields[b"rid"] for fields in stamped])
                checks.extend([(time.perf_counter() - started) * 1000.0] * len(stamped))
            await r.xack(keys.results, GROUP_C, *[eid for eid, _ in entries])
            done += len(entries)
    out = {"t_first": t_first, "t_last": time.time(), "count": done, "cpu_s": time.process_time() - cpu0}
    if samples:
        out["samples_ms"] = [round(x, 4) for x in samples]
        out["check_ms"] = [round(x, 4) for x in checks]
    await r.aclose()
    return out


def main() -> None:
    a = _parse()
    if a.rate > 0 and a.mode != "async":
        raise SystemExit("--rate needs --mode async")
    if a.mode == "sync":
        out = run_sync(a)
    elif a.rate > 0:
        out = run_on_redroll_loop(run_async(a))
    else:
        out = asyncio.run(run_async(a))
    write_json_atomic(a.out, out)


if __name__ == "__main__":
    main()
