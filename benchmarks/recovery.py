"""How long a dead worker's batch takes to recover, beside the time of one generation.

    python -m benchmarks.recovery [--requests 64] [--tokens 2000] [--token-ms 2] [--survivors 3]
                                  [--claim-idle-ms 1500] [--recovery-split halving|alone] [--json-out FILE]

One synthetic worker (``--slots`` = ``--max-inflight`` = the requests) claims every request, each
``--tokens`` tokens long; ``--survivors`` more workers start, then the first is SIGKILLed while it
generates. Printed: the time from the kill to the last of its records, ``claim_idle``, and one
generation's time (the engine time of the recovered records, median). With ``recovery_split``
"halving" the recovery takes about ``claim_idle`` + a reclaim pass + one generation; with "alone"
one generation per request, one after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import time
from typing import Any

import redis.asyncio as aredis

from benchmarks.harness import (
    BenchError,
    Procs,
    Server,
    emit_json,
    make_base_dir,
    new_namespace,
    new_run_dir,
    redroll_env,
)
from benchmarks.runs import PY
from redroll.producer.client import make_request, send
from redroll.shared.codec import decode_record
from redroll.shared.keys import WORKERS_GROUP, Keys
from redroll.shared.settings import Settings
from tests.support import poll


def worker_argv(slots: int, token_ms: float) -> list[str]:
    return [PY, "-m", "redroll.cli", "worker", "--engine", "synthetic", "--token-ms", str(token_ms),
            "--slots", str(slots), "--max-inflight", str(slots)]


async def _wait(predicate: Any, timeout: float, what: str, procs: Procs) -> Any:
    """Poll ``predicate`` (the shared poller); fail early when a process other than the victim died."""
    return await poll.wait_until(predicate, timeout, 0.02, what=what, error=BenchError,
                                 check=lambda: procs.check_alive(ignore=("victim",)))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    server = Server()
    ns = new_namespace("recovery")
    keys = Keys(ns)
    settings = Settings(redis_url=server.url, namespace=ns, claim_idle_ms=args.claim_idle_ms,
                        recovery_split=args.recovery_split)
    env = redroll_env(server, ns, REDROLL_CLAIM_IDLE_MS=args.claim_idle_ms, REDROLL_HEARTBEAT_S=0.5,
                      REDROLL_RECOVERY_SPLIT=args.recovery_split)
    r = aredis.Redis.from_url(server.url)
    run_dir = new_run_dir(make_base_dir(), "recovery")
    try:
        with Procs(run_dir) as procs:
            victim = procs.spawn("victim", worker_argv(args.requests, args.token_ms), env)
            await _wait(lambda: r.hlen(keys.workers), 60, "the first worker", procs)
            rids = [f"rec-{i}" for i in range(args.requests)]
            await send(settings, r, [make_request(request_id=rid, prompt=rid,
                                                  sampling_params={"max_new_tokens": args.tokens}) for rid in rids])

            async def all_claimed() -> bool:
                info = await r.xpending(keys.requests, WORKERS_GROUP)
                return info["pending"] == args.requests
            await _wait(all_claimed, 30, "the first worker to claim every request", procs)
            for i in range(args.survivors):
                procs.spawn(f"survivor-{i}", worker_argv(max(args.requests, 32), args.token_ms), env)

            async def all_up() -> bool:
                return await r.hlen(keys.workers) >= 1 + args.survivors
            await _wait(all_up, 60, "the survivors", procs)
            if await r.xlen(keys.results):
                raise RuntimeError("the first worker finished before the kill: use more --tokens")
            victim.popen.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            victim.popen.wait()

            async def recovered() -> bool:
                return await r.xlen(keys.results) >= args.requests
            await _wait(recovered, args.timeout, "the dead worker's requests to finish", procs)
            recovery_s = time.monotonic() - killed
            records = [decode_record(f) for _, f in await r.xrange(keys.results)]
    finally:
        await r.aclose()
        server.stop()
    engine_s = statistics.median(rec.meta_info["engine_ms"] for rec in records) / 1000.0
    result = {
        "recovery_split": args.recovery_split, "requests": args.requests, "tokens": args.tokens,
        "token_ms": args.token_ms, "survivors": args.survivors, "claim_idle_s": args.claim_idle_ms / 1000.0,
        "recovery_s": round(recovery_s, 3), "one_generation_s": round(engine_s, 3),
        "statuses": sorted({rec.status.value for rec in records}),
        "records": len(records), "distinct": len({rec.request_id for rec in records}),
    }
    print(f"recovery ({args.recovery_split}): {args.requests} requests of {args.tokens} tokens on a worker "
          f"SIGKILLed among {1 + args.survivors}: the last record {recovery_s:.2f} s after the kill; "
          f"claim_idle {args.claim_idle_ms / 1000:.2f} s, one generation {engine_s:.2f} s "
          f"(recovery = claim_idle + {recovery_s - args.claim_idle_ms / 1000:.2f} s = "
          f"claim_idle + {(recovery_s - args.claim_idle_ms / 1000) / engine_s:.2f} generations)")
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--token-ms", type=float, default=2.0)
    p.add_argument("--survivors", type=int, default=3)
    p.add_argument("--claim-idle-ms", type=int, default=1500)
    p.add_argument("--recovery-split", choices=("halving", "alone"), default="halving")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    result = asyncio.run(run(args))
    emit_json(result, args.json_out)


if __name__ == "__main__":
    main()
