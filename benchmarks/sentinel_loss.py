"""What a Sentinel failover loses, with and without ``wait_replicas``, and what waiting costs.

Each run starts a primary, one replica and three sentinels (down-after-milliseconds 1000) on
loopback ports, two worker processes (synthetic engine) and a consumer process (group ``loss``,
a handler appending one JSON line per application), all given only the ``redis+sentinel://``
URL. The harness sends ``--requests`` fire-and-forget requests in chunks; once a quarter of them
were applied it SIGKILLs the primary, waits for the sentinels to promote the replica, and starts
the killed node again as a replica (as a supervisor would). A request is *acknowledged* when its
``send`` returned (a send cut off by the failover is sent again until it is acknowledged). At the
end it counts the acknowledged requests whose callback never ran (**lost**) and those applied
more than once (**twice**).

``--replica-behind-ms MS``: the replica reads the replication stream through a proxy that hands
it on MS later (a replica behind its primary, as across zones or under load); what the proxy
holds when the primary dies never reaches the replica. Without it the replica is on loopback,
a fraction of a millisecond behind.

``--cost`` instead times submits on a healthy group: one ``send`` of 1 and of 100 requests,
with and without ``wait_replicas=1``.

    python -m benchmarks.sentinel_loss [--requests 2000] [--runs 3] [--wait-replicas 1]
                                       [--replica-behind-ms 200] [--cost]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import redis

from redroll.producer.client import make_request, send_each
from redroll.shared.connection import connect
from redroll.shared.scripts import DuplicateRequestError
from redroll.shared.settings import Settings
from redroll.testing.embedded_sentinel import start_sentinel_group

ROOT = Path(__file__).resolve().parents[1]
APPLIED_ENV = "REDROLL_CHAOS_APPLIED"  # (the chaos harness's handler: benchmarks.chaos:apply_record)


def _env(settings: Settings, applied: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", REDROLL_REDIS_URL=settings.redis_url,
               REDROLL_NAMESPACE=settings.namespace, REDROLL_CLAIM_IDLE_MS=str(settings.claim_idle_ms),
               REDROLL_MAX_DELIVERIES=str(settings.max_deliveries),
               REDROLL_WAIT_REPLICAS=str(settings.wait_replicas),
               REDROLL_WAIT_TIMEOUT_MS=str(settings.wait_timeout_ms))
    env[APPLIED_ENV] = str(applied)
    return env


def _applied(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [json.loads(line)["request_id"] for line in path.read_text().splitlines() if line.endswith("}")]


async def _send_until_acknowledged(settings: Settings, r: Any, requests: list, killer: asyncio.Task) -> int:
    """Send ``requests``; those cut off are sent again until each is acknowledged (queued by this
    send, or found queued by an earlier one). Returns how many sends were cut off."""
    cut, pending = 0, requests
    while pending:
        try:
            outcomes = await send_each(settings, r, [make_request(**x) for x in pending])
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            if killer.done() and killer.exception() is not None:
                raise killer.exception() from None  # (no failover, no restarted replica: it would never end)
            cut += 1
            await asyncio.sleep(0.2)
            continue
        pending = [x for x, o in zip(pending, outcomes)
                   if isinstance(o, Exception) and not isinstance(o, DuplicateRequestError)]
    return cut


async def one_run(n: int, wait_replicas: int, behind_ms: float, workdir: Path) -> dict[str, Any]:
    group = start_sentinel_group(replicas=1, sentinels=3, down_after_ms=1000, replica_delay_ms=behind_ms)
    settings = Settings(redis_url=group.url, namespace="loss", claim_idle_ms=1500, max_deliveries=10,
                        wait_replicas=wait_replicas, wait_timeout_ms=500)
    applied = workdir / f"applied-{time.monotonic_ns()}.jsonl"
    logs = open(workdir / "procs.log", "ab")
    base = [sys.executable, "-m", "redroll.cli"]
    procs = [subprocess.Popen(base + ["worker", "--engine", "synthetic", "--token-ms", "20", "--max-inflight", "8"],
                              env=_env(settings, applied), stdout=logs, stderr=subprocess.STDOUT) for _ in range(2)]
    procs.append(subprocess.Popen(base + ["consume", "--group", "loss", "--handler",
                                          "apply=benchmarks.chaos:apply_record"],
                                  env=_env(settings, applied), stdout=logs, stderr=subprocess.STDOUT))
    r = connect(settings)
    result: dict[str, Any] = {"requests": n, "wait_replicas": wait_replicas, "replica_behind_ms": behind_ms}
    try:
        async def kill() -> None:
            while len(_applied(applied)) < n // 4:
                await asyncio.sleep(0.02)
            result["applied_at_kill"] = len(_applied(applied))
            started = time.monotonic()
            old = await asyncio.to_thread(group.kill_primary)
            await asyncio.to_thread(group.wait_for_failover, old)
            result["failover_s"] = round(time.monotonic() - started, 2)
            await asyncio.to_thread(group.restart, old)

        killer = asyncio.create_task(kill())
        cut = 0
        for chunk in range(0, n, 25):
            cut += await _send_until_acknowledged(settings, r, [
                dict(request_id=f"r-{i}", prompt=str(i), callback="apply", sampling_params={"max_new_tokens": 4})
                for i in range(chunk, min(n, chunk + 25))], killer)
            await asyncio.sleep(0.1)  # (about 250 requests a second: the sends go on across the failover)
        await killer
        result["sends_cut_off"] = cut
        last, still = -1, time.monotonic()
        while time.monotonic() - still < 5 and len(set(_applied(applied))) < n:  # settled: 5 s without change
            count = len(_applied(applied))
            if count != last:
                last, still = count, time.monotonic()
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)  # (a late duplicate)
        counts = Counter(_applied(applied))
        result["lost"] = n - len(counts)
        result["twice"] = sum(1 for c in counts.values() if c > 1)
    finally:
        await r.aclose()
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        group.stop()
        logs.close()
    return result


async def _time_sends(settings: Settings, size: int, calls: int) -> float:
    r = connect(settings)
    try:
        times = []
        for c in range(calls):
            reqs = [make_request(request_id=f"c{settings.wait_replicas}-{size}-{c}-{i}", prompt="x")
                    for i in range(size)]
            t = time.perf_counter()
            await send_each(settings, r, reqs)
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1000
    finally:
        await r.aclose()


async def cost() -> dict[str, float]:
    group = start_sentinel_group(replicas=1, sentinels=3)
    try:
        out = {}
        for wait in (0, 1):
            settings = Settings(redis_url=group.url, namespace=f"cost{wait}", wait_replicas=wait)
            for size in (1, 100):
                out[f"send_{size}_wait{wait}_ms"] = round(await _time_sends(settings, size, 200), 3)
        return out
    finally:
        group.stop()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sentinel_loss", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--wait-replicas", type=int, default=0)
    p.add_argument("--replica-behind-ms", type=float, default=0.0)
    p.add_argument("--cost", action="store_true", help="time submits with and without wait_replicas instead")
    args = p.parse_args(argv)
    if args.cost:
        print(json.dumps(asyncio.run(cost())))
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="redroll-sentinel-loss-"))
    runs = []
    for _ in range(args.runs):
        runs.append(asyncio.run(one_run(args.requests, args.wait_replicas, args.replica_behind_ms, workdir)))
        print(json.dumps(runs[-1]), flush=True)
    for key in ("lost", "twice", "failover_s"):
        values = sorted(run[key] for run in runs)
        print(f"{key}: median {statistics.median(values)}, range {values[0]}-{values[-1]} over {len(values)} runs")
    print(f"logs: {workdir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
