"""What streaming and checkpoints cost Redis: the same requests streamed, checkpointed and plain, side by side.

    python -m benchmarks.stream_cost [--requests 64] [--tokens 256] [--token-ms 1] [--runs 3]
                                     [--chunk-tokens 8] [--chunk-ms 50] [--checkpointed]
                                     [--checkpoint-tokens 32] [--checkpoint-s 2]

On a private redis-server, one in-process worker on the synthetic engine (``--token-ms`` per
token, so chunks really come while a request runs) serves ``--requests`` requests of
``--tokens`` tokens, all submitted at once, in passes per run: plain (``Producer.generate``; the
worker's ``continuation`` off, so a plain request saves nothing),
streamed (``Producer.stream``, every chunk read) and, with ``--checkpointed``, plain requests
that the worker checkpoints (``resumable``, every ``--checkpoint-tokens`` tokens and
``--checkpoint-s`` seconds, whichever later: the pipeline's defaults unless given). Reported per
run: the wall time of each pass, the chunks written, the first chunk's latency (median over the
streamed requests, from the call to its first chunk), redis-server's command time (``INFO
commandstats``: usec) and CPU (user + system) per request of each pass, and per token the extra
of a streamed (checkpointed) token over a plain one; then the median and range over the runs.
The passes of a run have the same wall time within a few percent (the engine's pace decides it),
so the server's idle work cancels out of the difference. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from typing import Awaitable, Callable

from benchmarks.harness import median_range
from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.producer.client import Producer
from redroll.shared.settings import Settings
from redroll.testing.embedded import start_redis_server


async def command_usec(r) -> float:
    stats = await r.info("commandstats")
    return sum(float(v.get("usec", 0)) for v in stats.values() if isinstance(v, dict))


async def server_cpu_usec(r) -> float:
    cpu = await r.info("cpu")
    return (float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])) * 1e6


async def one_pass(producer: Producer, r, args, kind: str) -> dict[str, float]:
    sp = {"max_new_tokens": args.tokens, "ignore_eos": True}
    tag = uuid.uuid4().hex[:6]
    usec, cpu, started = await command_usec(r), await server_cpu_usec(r), time.perf_counter()
    chunks = 0
    first: list[float] = []

    async def one(i: int) -> None:
        nonlocal chunks
        if kind == "streamed":
            begun, seen = time.perf_counter(), False
            async for _ in producer.stream(request_id=f"s-{tag}-{i}", prompt="x", sampling_params=sp, timeout=600):
                if not seen:
                    first.append(time.perf_counter() - begun)
                    seen = True
                chunks += 1
        elif kind == "checkpointed":
            await producer.generate(request_id=f"c-{tag}-{i}", input_ids=[1, 2, 3], sampling_params=sp,
                                    resumable=True, timeout=600)
        else:
            await producer.generate(request_id=f"p-{tag}-{i}", prompt="x", sampling_params=sp, timeout=600)

    await asyncio.gather(*(one(i) for i in range(args.requests)))
    wall = time.perf_counter() - started
    return {"wall_s": wall, "redis_usec": await command_usec(r) - usec, "redis_cpu_usec": await server_cpu_usec(r) - cpu,
            "chunks": chunks, "first_chunk_ms": statistics.median(first) * 1000.0 if first else 0.0}


async def one_run(url: str, args) -> dict[str, float]:
    settings = Settings(redis_url=url, namespace="sc" + uuid.uuid4().hex[:8], stream_chunk_tokens=args.chunk_tokens,
                        stream_chunk_ms=args.chunk_ms, checkpoint_min_new_tokens=0,
                        checkpoint_tokens=args.checkpoint_tokens, checkpoint_interval_s=args.checkpoint_s,
                        # (plain requests are not saved: continuation off, where the code has it)
                        **({"continuation": False} if "continuation" in Settings.__dataclass_fields__ else {}))
    engine = SyntheticEngine(token_ms=args.token_ms)
    worker = Worker(settings, engine, max_inflight=args.requests, block_ms=100)
    task = asyncio.create_task(worker.run())
    passes = ["plain", "streamed"] + (["checkpointed"] if args.checkpointed else [])
    out: dict[str, dict[str, float]] = {}
    try:
        async with Producer(settings, block_ms=100) as producer:
            r = producer.redis
            warm = argparse.Namespace(**{**vars(args), "tokens": 16})
            await one_pass(producer, r, warm, "plain")  # warm-up: connections, the function library
            await one_pass(producer, r, warm, "streamed")  # (and the stream readers' connections)
            for kind in passes:
                saves = worker.stats.checkpoints
                out[kind] = await one_pass(producer, r, args, kind)
                out[kind]["saves"] = worker.stats.checkpoints - saves
    finally:
        worker.request_stop()
        await task
    tokens = args.requests * args.tokens
    plain = out["plain"]
    result = {"plain_wall_s": plain["wall_s"], "streamed_wall_s": out["streamed"]["wall_s"],
              "chunks_written": out["streamed"]["saves"],
              "tokens_per_chunk": tokens / max(1, out["streamed"]["saves"]),
              "first_chunk_ms": out["streamed"]["first_chunk_ms"],
              "plain_redis_usec_per_request": plain["redis_usec"] / args.requests,
              "plain_redis_usec_per_token": plain["redis_usec"] / tokens,
              "plain_redis_cpu_usec_per_token": plain["redis_cpu_usec"] / tokens}
    for kind in passes[1:]:
        extra, extra_cpu = out[kind]["redis_usec"] - plain["redis_usec"], out[kind]["redis_cpu_usec"] - plain["redis_cpu_usec"]
        result.update({f"{kind}_redis_usec_per_request": out[kind]["redis_usec"] / args.requests,
                       f"{kind}_extra_redis_usec_per_token": extra / tokens,
                       f"{kind}_extra_redis_cpu_usec_per_token": extra_cpu / tokens,
                       f"{kind}_redis_usec_per_write": extra / max(1, out[kind]["saves"])})
    if args.checkpointed:
        result.update({"checkpointed_wall_s": out["checkpointed"]["wall_s"], "checkpoints": out["checkpointed"]["saves"],
                       "tokens_per_checkpoint": tokens / max(1, out["checkpointed"]["saves"])})
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--chunk-tokens", type=int, default=8)
    p.add_argument("--chunk-ms", type=float, default=50.0)
    p.add_argument("--token-ms", type=float, default=1.0)
    p.add_argument("--checkpointed", action="store_true",
                   help="a third pass: plain requests checkpointed at the interval below")
    p.add_argument("--checkpoint-tokens", type=int, default=Settings.checkpoint_tokens)
    p.add_argument("--checkpoint-s", type=float, default=Settings.checkpoint_interval_s)
    p.add_argument("--runs", type=int, default=3)
    print_runs(p.parse_args(), one_run)


def print_runs(args: argparse.Namespace, one_run: Callable[[str, argparse.Namespace], Awaitable[dict]]) -> None:
    """``args.runs`` runs of ``one_run(url, args)`` on one private redis-server, printed as JSON
    with each figure's median and range."""
    server = start_redis_server()
    try:
        runs = [asyncio.run(one_run(server.url, args)) for _ in range(args.runs)]
    finally:
        server.stop()
    summary = median_range(runs)
    print(json.dumps({"args": vars(args), "runs": runs, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
