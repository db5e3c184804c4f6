"""Housekeeping's rid-key sweep: what releasing the rid keys of cancelled requests costs.

    python -m benchmarks.rid_sweep [--keys 100000] [--runs 3]

Producers may not delete rid keys (docs/acl.md), so ``redroll gc`` and every worker's
housekeeping scan ``{ns}:rid:*`` and check each key's entry against the request streams
(``release_rids``, 500 keys a call). On a private redis-server, ``--keys`` requests are queued
(their rid keys all live: every key costs a lookup in each request stream, the sweep's worst
case), then half of them are deleted from the stream as a cancel does. Reported per run: the
sweep's wall time with every key live (nothing released), and with half stale (released), and
the Redis command time per key (``INFO commandstats``, fcall). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

from redis.asyncio import Redis

from redroll.ops.gc import collect_garbage
from redroll.shared.scripts import Scripts
from redroll.shared.settings import Settings
from redroll.testing.embedded import start_redis_server


async def fcall_usec(r: Redis) -> float:
    stats = await r.info("commandstats")
    return float(stats.get("cmdstat_fcall", {}).get("usec", 0))


async def one_run(r: Redis, n: int) -> dict[str, float]:
    keys = Settings(namespace="sweep" + uuid.uuid4().hex[:8]).keys
    scripts = Scripts(r)
    await scripts.load_all()
    entries = []
    for start in range(0, n, 1000):
        items = [(keys.rid(f"r-{i}"), "t", f"r-{i}", None, b"x") for i in range(start, min(n, start + 1000))]
        async with r.pipeline(transaction=False) as pipe:
            scripts.submit_many_in(pipe, requests_key=keys.requests, rid_ttl_s=3600, items=items)
            (replies,) = await pipe.execute()
        entries += [reply[1].decode() for reply in replies]
    out: dict[str, float] = {}
    for label in ("all_live", "half_stale"):
        if label == "half_stale":
            for start in range(0, n, 2000):
                await r.xdel(keys.requests, *entries[start:min(n, start + 2000):2])
        before = await fcall_usec(r)
        t0 = time.perf_counter()
        report = await collect_garbage(r, keys, reply_ttl_s=3600)
        out[f"{label}_s"] = time.perf_counter() - t0
        out[f"{label}_fcall_us_per_key"] = (await fcall_usec(r) - before) / n
        out[f"{label}_released"] = len(report.rid_keys)
    await r.delete(keys.requests)
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    server = start_redis_server()
    r = Redis(port=server.port)
    try:
        runs = [await one_run(r, args.keys) for _ in range(args.runs)]
    finally:
        await r.aclose()
        server.stop()
    print(f"rid-key sweep, {args.keys} rid keys, {args.runs} runs: median [min, max]")
    for name in runs[0]:
        values = [run[name] for run in runs]
        print(f"  {name:32} {statistics.median(values):10.3f}  [{min(values):.3f}, {max(values):.3f}]")


if __name__ == "__main__":
    asyncio.run(main())
