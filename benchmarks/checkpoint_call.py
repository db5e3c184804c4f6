"""One checkpoint_many call, isolated: Redis's time and CPU a save.

    python -m benchmarks.checkpoint_call [--saves 64] [--calls 120] [--tokens 32] [--streamed] [--logged]
                                         [--json-out FILE]

On a private redis-server, ``--saves`` entries pending to one consumer; then ``--calls`` calls of
``checkpoint_many`` in a row, each appending one part of ``--tokens`` tokens (ids and logprobs, as
a worker packs them; with ``--streamed`` a text too, and each part also a chunk of one producer's
chunk stream) to every entry's checkpoint, each save after an entry's first sending the
checkpoint's length. ``--logged``: each save is also a checkpoint event (the event log on, as
``event_log=incidents`` logs a request that is not streamed). Reported, over the calls after the
first two: the function's time a save (``INFO commandstats``, usec of FCALL), median and minimum,
and redis-server's CPU a save (user + system, with two ``INFO`` calls a call in it). What a save
costs in a live worker, whose caches are cold between ticks, is about 1.8 times this
(``benchmarks.stream_cost``). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics

import redis.asyncio as aioredis

from redroll.shared.checkpoint_saves import CheckpointSave, PartSave, checkpoint_outcomes
from redroll.shared.chunks import Part, encode_part
from redroll.shared.events import EventLog
from redroll.shared.keys import submitted_as
from redroll.shared.scripts import Scripts
from redroll.testing.embedded import start_redis_server

STREAM, GROUP, CONSUMER = "{cc}:requests", "workers", "w"


async def measure(url: str, args: argparse.Namespace) -> dict[str, float]:
    r = aioredis.from_url(url)
    scripts = Scripts(r, EventLog() if args.logged else None)
    await scripts.load_all()
    await r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    entries = [(await r.xadd(STREAM, {"x": "1"})).decode() for _ in range(args.saves)]
    await r.xreadgroup(GROUP, CONSUMER, {STREAM: ">"}, count=args.saves)
    for i, entry in enumerate(entries):
        await r.hset("{cc}:own:p", f"r{i}", submitted_as(STREAM, entry))
    part = encode_part(Part(token_ids=list(range(1000, 1000 + args.tokens)), logprobs=[-0.123456] * args.tokens,
                            worker=CONSUMER, weight_version="v1", text="abc " * args.tokens if args.streamed else None))
    saved, length = [0] * args.saves, [None] * args.saves
    usec, cpu = [], []
    for n in range(args.calls):
        saves = [CheckpointSave(requests_key=STREAM, partial_key=f"{{cc}}:partial:r{i}", entry_id=entries[i],
                                saved=saved[i], adding=args.tokens, part=part, length=length[i], number=n + 1,
                                logged=args.logged,
                                **({"chunks_key": "{cc}:chunks:p", "owner_key": "{cc}:own:p", "check_owner": n == 0,
                                    "refresh_ttl": n % 10 == 0} if args.streamed else {}))
                 for i in range(args.saves)]
        stats, info = await r.info("commandstats"), await r.info("cpu")
        if args.parts and n > 0:  # (after a first consolidating call, parts only)
            reply = await scripts.save_parts_in(r, group=GROUP, consumer=CONSUMER, parts_key="{cc}:parts:w", parts=[
                PartSave(requests_key=STREAM, entry_id=entries[i], request_id=f"r{i}", before=saved[i],
                         adding=args.tokens, part=part, chunks_key="{cc}:chunks:p" if args.streamed else None,
                         refresh_ttl=n % 10 == 0) for i in range(args.saves)], keep_ms=60_000, parts_ttl_s=600,
                chunks_ttl_s=600)
        else:
            reply = await scripts.checkpoint_many_in(r, group=GROUP, consumer=CONSUMER, saves=saves, ttl_s=600,
                                                     chunks_ttl_s=600)
        stats2, info2 = await r.info("commandstats"), await r.info("cpu")
        assert all(code == 1 for code, _ in checkpoint_outcomes(reply))
        for i in range(args.saves):
            saved[i] += args.tokens
            if not (args.parts and n > 0):
                length[i] = (length[i] or 64) + len(part)
        if n >= 2:
            usec.append((stats2["cmdstat_fcall"]["usec"] - stats["cmdstat_fcall"]["usec"]) / args.saves)
            cpu.append(((info2["used_cpu_user"] + info2["used_cpu_sys"]) - (info["used_cpu_user"] + info["used_cpu_sys"]))
                       * 1e6 / args.saves)
    await r.aclose()
    return {"part_bytes": len(part), "function_usec_per_save": statistics.median(usec),
            "function_usec_per_save_min": min(usec), "redis_cpu_usec_per_save": statistics.median(cpu)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--saves", type=int, default=64)
    p.add_argument("--calls", type=int, default=120)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--streamed", action="store_true")
    p.add_argument("--logged", action="store_true")
    p.add_argument("--parts", action="store_true",
                   help="after the first call, save_parts calls: each save a part of the parts stream only")
    p.add_argument("--json-out", help="also write the JSON here")
    args = p.parse_args()
    server = start_redis_server()
    try:
        result = asyncio.run(measure(server.url, args))
    finally:
        server.stop()
    text = json.dumps({"args": vars(args), **result}, indent=1)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
