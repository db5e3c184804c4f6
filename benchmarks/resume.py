"""Resume after a dead worker: how much decode a SIGKILL costs with and without checkpoints.

    python -m benchmarks.resume [--requests 16] [--tokens 2000] [--token-ms 5] [--json-out FILE]

Two synthetic worker processes (``--token-ms`` per token, 8 in flight each) on a private
redis-server run ``--requests`` long single-sample requests at once; halfway through, one worker
is SIGKILLed and a fresh one started in its place. Once with ``resumable`` requests (checkpoints
every ``--checkpoint-tokens`` tokens or 0.5 s), once without. Reported per run: wall time until the
last record, the killed worker's requests' finish time after the kill, tokens carried over from
checkpoints, tokens lost per killed request, and the records' lengths (all must be complete).
Then the cost, without a kill (``--cost-requests`` requests, checkpoints on vs off): throughput,
bytes sent to Redis and AOF bytes per request, peak Redis memory. redis-server runs with AOF on
(``appendfsync everysec``). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

from benchmarks.harness import emit_json, stop_processes
from tests.support import poll

ROOT = Path(__file__).resolve().parent.parent


def worker(url: str, namespace: str, args: argparse.Namespace, log: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env.update(REDROLL_REDIS_URL=url, REDROLL_NAMESPACE=namespace, REDROLL_CLAIM_IDLE_MS=str(args.claim_idle_ms),
               REDROLL_HEARTBEAT_S="0.5", REDROLL_CHECKPOINT_TOKENS=str(args.checkpoint_tokens),
               REDROLL_CHECKPOINT_INTERVAL_S="0.5", REDROLL_CHECKPOINT_MIN_NEW_TOKENS="100",
               REDROLL_LOG_LEVEL="warning", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    cmd = [sys.executable, "-m", "redroll.cli", "worker", "--engine", "synthetic", "--token-ms", str(args.token_ms),
           "--max-inflight", "8"]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=open(log, "ab"), stderr=subprocess.STDOUT)


@contextlib.asynccontextmanager
async def fleet(url: str, args: argparse.Namespace, log: Path, name: str) -> AsyncIterator[tuple]:
    """Two worker processes on a fresh namespace, a client and a producer: (settings, r, producer, procs)."""
    from redroll.producer import Producer
    from redroll.shared.connection import connect
    from redroll.shared.settings import Settings

    namespace = f"{name}{uuid.uuid4().hex[:8]}"
    settings = Settings(redis_url=url, namespace=namespace, claim_idle_ms=args.claim_idle_ms)
    procs = [worker(url, namespace, args, log) for _ in range(2)]
    try:
        async with connect(settings) as r, Producer(settings) as p:
            async def both_up() -> bool:
                return await r.hlen(settings.keys.workers) >= 2

            await poll.wait_until(both_up, 60, 0.1, what="two workers' heartbeats", error=RuntimeError)
            yield settings, r, p, procs
    finally:
        stop_processes(procs, timeout=20)


async def one_run(url: str, args: argparse.Namespace, resumable: bool, log: Path) -> dict[str, Any]:
    async with fleet(url, args, log, "resume") as (settings, r, p, procs):
        t0 = time.monotonic()
        futures = await p.submit_many([dict(request_id=f"long-{i}", input_ids=[i + 1, 2, 3], resumable=resumable,
                                            sampling_params={"max_new_tokens": args.tokens})
                                       for i in range(args.requests)])
        await asyncio.sleep(args.tokens * args.token_ms / 1000.0 / 2)
        beats = {k.decode(): json.loads(v) for k, v in (await r.hgetall(settings.keys.workers)).items()}
        pids = {b["pid"]: name for name, b in beats.items()}
        victim = procs[0]
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        killed_at = time.monotonic()
        procs.append(worker(url, settings.namespace, args, log))
        records = await asyncio.gather(*futures)
        end = time.monotonic()
    killed_name = pids.get(procs[0].pid)
    hit = [rec for rec in records if rec.meta_info.get("attempt", 1) > 1]
    # Each of the killed worker's requests had run from the submit to the kill (they all started at
    # once): that many tokens were made, and all but what a checkpoint carried over were lost.
    made = min(args.tokens, int((killed_at - t0) * 1000.0 / args.token_ms))
    lost = [made - rec.meta_info.get("resumed_from", 0) for rec in hit]
    return {
        "resumable": resumable, "wall_s": round(end - t0, 2), "killed_worker": killed_name,
        "requests_on_the_killed_worker": len(hit),
        "their_finish_after_kill_s": round(end - killed_at, 2) if hit else None,
        "tokens_made_before_the_kill_each": made,
        "tokens_carried_over": sum(rec.meta_info.get("resumed_from", 0) for rec in records),
        "tokens_lost_per_request": {"mean": round(sum(lost) / len(lost), 1) if lost else 0, "max": max(lost, default=0)},
        "all_complete": all(len(rec.output_token_ids[0]) == args.tokens for rec in records),
    }


async def cost_run(url: str, args: argparse.Namespace, resumable: bool, log: Path) -> dict[str, Any]:
    """No kill: what checkpointing costs (wall time, bytes sent to Redis, peak memory)."""
    async with fleet(url, args, log, "cost") as (_, r, p, _procs):
        before = await r.info()
        peak = before["used_memory"]
        t0 = time.monotonic()
        futures = await p.submit_many([dict(request_id=f"c-{i}", input_ids=[i + 1, 2, 3], resumable=resumable,
                                            sampling_params={"max_new_tokens": args.tokens})
                                       for i in range(args.cost_requests)])
        pending = set(futures)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=0.2)
            peak = max(peak, (await r.info("memory"))["used_memory"])
        wall = time.monotonic() - t0
        after = await r.info()
    n = args.cost_requests
    return {"resumable": resumable, "wall_s": round(wall, 2),
            "requests_per_s": round(n / wall, 2),
            "bytes_to_redis_per_request": round((after["total_net_input_bytes"] - before["total_net_input_bytes"]) / n),
            "aof_bytes_per_request": round((after.get("aof_current_size", 0) - before.get("aof_current_size", 0)) / n),
            "peak_memory_above_start_mb": round((peak - before["used_memory"]) / 1e6, 2)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from redroll.testing.embedded import start_redis_server

    work = Path(tempfile.mkdtemp(prefix="redroll-resume-"))
    log = work / "workers.log"
    server = start_redis_server("--appendonly", "yes", "--appendfsync", "everysec", directory=str(work))
    try:
        off = await one_run(server.url, args, False, log)
        on = await one_run(server.url, args, True, log)
        cost_off = await cost_run(server.url, args, False, log)
        cost_on = await cost_run(server.url, args, True, log)
    finally:
        server.stop()
    ideal_s = args.tokens * args.token_ms / 1000.0
    return {"config": {k: v for k, v in vars(args).items() if k != "json_out"}, "uninterrupted_request_s": ideal_s,
            "without_checkpoints": off, "with_checkpoints": on,
            "cost": {"without_checkpoints": cost_off, "with_checkpoints": cost_on,
                     "throughput_ratio": round(cost_on["requests_per_s"] / cost_off["requests_per_s"], 3)},
            "log": str(log)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.resume", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--token-ms", type=float, default=5.0)
    parser.add_argument("--checkpoint-tokens", type=int, default=100)
    parser.add_argument("--claim-idle-ms", type=int, default=2000)
    parser.add_argument("--cost-requests", type=int, default=48, help="requests of the no-kill cost runs")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    emit_json(result, args.json_out)
    ok = result["without_checkpoints"]["all_complete"] and result["with_checkpoints"]["all_complete"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
