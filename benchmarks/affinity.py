"""Prefix affinity bench: does a group's or a session's work run where its prefix is cached?

    python -m benchmarks.affinity [--workers 4] [--lanes 8] [--json-out FILE]

Each scenario runs twice on a fresh pipeline, with affinity lanes off (L = 0) and on, against the
same fleet shape: ``--workers`` worker processes, transformers engine on the built-in tiny model
with its prefix cache (``--prefix-cache-tokens``), on one private redis-server.

- groups: 64 groups of 8 single-sample members submitted at once (``--repeat`` times on the
  same fleet, new prompts each time; medians). Reported: workers per group
  (mean), prefill tokens the model computed (from the workers' own counters, the tokens their
  prefill forwards ran, not from ``cached_tokens``), wall time, p95 queue wait; and a
  teacher-forced recomputation of records served from the cache (max |logprob difference|).
- sessions: 64 concurrent 3-turn sessions (each turn resubmits the conversation so far with the
  session's key). Reported: cache hit rate (cached prompt tokens / prompt tokens, from
  ``cached_tokens``) against the best possible (every turn after the first cached up to its new
  message), turns that ran on the previous turn's worker.
- hot key: 8 groups of 64 on 16 slots (4 per worker): wall time (``--repeat`` runs, median).

Prints one JSON document. Not part of the test suite (it takes a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.harness import emit_json, stop_processes

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny-random:0"


def worker_env(url: str, namespace: str, lanes: int, heartbeat_s: float) -> dict[str, str]:
    env = dict(os.environ)
    env.update(REDROLL_REDIS_URL=url, REDROLL_NAMESPACE=namespace, REDROLL_AFFINITY_LANES=str(lanes),
               REDROLL_HEARTBEAT_S=str(heartbeat_s), REDROLL_LOG_LEVEL="warning", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return env


def start_workers(args: argparse.Namespace, url: str, namespace: str, lanes: int, max_inflight: int,
                  log_dir: Path) -> list[subprocess.Popen]:
    cmd = [sys.executable, "-m", "redroll.cli", "worker", "--engine", "transformers", "--model-path", MODEL,
           "--max-inflight", str(max_inflight), "--max-batch-size", str(max_inflight),
           "--prefix-cache-tokens", str(args.prefix_cache_tokens)]
    env = worker_env(url, namespace, lanes, args.heartbeat_s)
    return [subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=open(log_dir / f"{namespace}-w{i}.log", "wb"),
                             stderr=subprocess.STDOUT) for i in range(args.workers)]


async def heartbeats(r: Any, keys: Any) -> dict[str, dict]:
    return {k.decode(): json.loads(v) for k, v in (await r.hgetall(keys.workers)).items()}


async def prefill_computed(r: Any, keys: Any) -> int:
    return sum(b.get("prefill_tokens", {}).get("computed", 0) for b in (await heartbeats(r, keys)).values())


async def wait_for_workers(r: Any, settings: Any, n: int, lanes: int, procs: list[subprocess.Popen]) -> None:
    from redroll.shared.lanes import lane_report

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a worker exited with {p.returncode} at start")
        beats = await heartbeats(r, settings.keys)
        ready = len([b for b in beats.values() if b.get("state") == "running"]) == n
        if ready and lanes:
            report = await lane_report(r, settings.keys, settings.partition_keys)
            ready = len({x["owner"] for x in report["per_lane"]} - {None}) == min(n, lanes) and \
                all(x["owner"] and "," not in x["owner"] for x in report["per_lane"])
        if ready:
            await asyncio.sleep(3 * settings.heartbeat_s)  # every worker has seen every other
            return
        await asyncio.sleep(0.2)
    raise RuntimeError("workers did not come up")


async def settle(r: Any, settings: Any, before: int) -> int:
    """Prefill tokens computed since ``before``, once every heartbeat reports the final count."""
    last, stable = -1, 0
    while stable < 3:
        await asyncio.sleep(settings.heartbeat_s)
        now = await prefill_computed(r, settings.keys)
        stable = stable + 1 if now == last else 0
        last = now
    return last - before


def p95(values: list[float]) -> float:
    return round(sorted(values)[int(0.95 * (len(values) - 1))], 1) if values else 0.0


def text_of(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))


async def scenario_groups(p: Any, rng: random.Random, groups: int, size: int, prompt_len: int,
                          max_new_tokens: int) -> dict[str, Any]:
    prompts = [text_of(rng, prompt_len) for _ in range(groups)]
    t0 = time.monotonic()
    handles = [await p.submit_group(size, group_id=f"g{uuid.uuid4().hex[:8]}", prompt=prompt,
                                    sampling_params={"max_new_tokens": max_new_tokens, "temperature": 1.0},
                                    return_logprob=True)
               for prompt in prompts]
    records = [await h.wait() for h in handles]
    wall = time.monotonic() - t0
    spread = [len({r.meta_info["worker"] for r in recs}) for recs in records]
    flat = [(prompt, r) for prompt, recs in zip(prompts, records) for r in recs]
    return {"wall_s": round(wall, 2), "workers_per_group": round(statistics.mean(spread), 3),
            "p95_queue_ms": p95([r.meta_info["queue_ms"] for _, r in flat]),
            "cached_tokens": sum(r.meta_info.get("cached_tokens", 0) for _, r in flat), "records": flat}


async def scenario_sessions(p: Any, rng: random.Random, sessions: int, turns: int, first_len: int, new_len: int,
                            max_new_tokens: int) -> dict[str, Any]:
    from redroll.engine_worker.engines.tiny_model import ByteTokenizer

    tok = ByteTokenizer()

    async def one() -> list[Any]:
        session = p.session()
        out = []
        for t in range(turns):
            message = tok.encode(text_of(rng, first_len if t == 0 else new_len))
            out.append((len(session.conversation), await session.turn(
                message, sampling_params={"max_new_tokens": max_new_tokens, "temperature": 1.0})))
        return out

    t0 = time.monotonic()
    runs = await asyncio.gather(*(one() for _ in range(sessions)))
    wall = time.monotonic() - t0
    prompt = cached = best = same = follow = 0
    for turns_ in runs:
        for i, (history, rec) in enumerate(turns_):
            prompt += rec.meta_info["prompt_tokens"]
            cached += rec.meta_info.get("cached_tokens", 0)
            best += history
            if i:
                follow += 1
                same += rec.meta_info["worker"] == turns_[i - 1][1].meta_info["worker"]
    return {"wall_s": round(wall, 2), "hit_rate": round(cached / prompt, 4), "best_hit_rate": round(best / prompt, 4),
            "of_best": round(cached / best, 4) if best else None, "same_worker_turns": f"{same}/{follow}"}


def teacher_forced_gap(records: list[tuple[str, Any]], sample: int = 48) -> tuple[float, int]:
    """Max |logprob - teacher-forced logprob| over records the cache served (cached_tokens > 0)."""
    from redroll.engine_worker.engines.tiny_model import ByteTokenizer, build_tiny_model, teacher_forced_logprobs

    model, tok = build_tiny_model(0), ByteTokenizer()
    served = [(prompt, r) for prompt, r in records if r.meta_info.get("cached_tokens", 0) > 0][:sample]
    gap = 0.0
    for prompt, rec in served:
        ref = teacher_forced_logprobs(model, tok.encode(prompt), rec.output_token_ids[0], 1.0)
        gap = max(gap, max(abs(a - b) for a, b in zip(rec.output_logprobs[0], ref)))
    return gap, len(served)


async def run_config(args: argparse.Namespace, url: str, lanes: int, log_dir: Path) -> dict[str, Any]:
    from redroll.producer import Producer
    from redroll.shared.connection import connect
    from redroll.shared.settings import Settings

    out: dict[str, Any] = {"lanes": lanes}
    rng = random.Random(args.seed)
    for name, max_inflight in (("groups", args.max_inflight), ("sessions", args.max_inflight), ("hot_key", 4)):
        namespace = f"aff{lanes}{name[:3]}{uuid.uuid4().hex[:6]}"
        settings = Settings(redis_url=url, namespace=namespace, affinity_lanes=lanes, heartbeat_s=args.heartbeat_s)
        procs = start_workers(args, url, namespace, lanes, max_inflight, log_dir)
        try:
            async with connect(settings) as r, Producer(settings) as p:
                await wait_for_workers(r, settings, args.workers, lanes, procs)
                before = await prefill_computed(r, settings.keys)
                if name == "groups":  # repeated on the same fleet (new prompts each time): medians
                    runs = [await scenario_groups(p, rng, 64, 8, args.prompt_len, args.max_new_tokens)
                            for _ in range(args.repeat)]
                    records = [x for run in runs for x in run.pop("records")]
                    res = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
                    res["wall_s_runs"] = [run["wall_s"] for run in runs]
                    res["prefill_tokens_computed"] = round(await settle(r, settings, before) / args.repeat)
                    res["prefill_tokens_uncached"] = round(sum(rec.meta_info["prompt_tokens"] for _, rec in records)
                                                           / args.repeat)
                    res["teacher_forced_max_gap"], res["teacher_forced_checked"] = teacher_forced_gap(records)
                elif name == "sessions":
                    res = await scenario_sessions(p, rng, 64, 3, args.prompt_len, 24, args.max_new_tokens)
                    res["prefill_tokens_computed"] = await settle(r, settings, before)
                else:
                    runs = [await scenario_groups(p, rng, 8, 64, args.prompt_len, args.max_new_tokens)
                            for _ in range(args.repeat)]
                    for run in runs:
                        run.pop("records")
                    res = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
                    res["wall_s_runs"] = [run["wall_s"] for run in runs]
                out[name] = res
        finally:
            stop_processes(procs)
        print(f"lanes={lanes} {name}: {json.dumps(out[name])}", file=sys.stderr, flush=True)
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from redroll.testing.embedded import start_redis_server

    log_dir = Path(tempfile.mkdtemp(prefix="redroll-affinity-"))
    server = start_redis_server()
    try:
        off = await run_config(args, server.url, 0, log_dir)
        on = await run_config(args, server.url, args.lanes, log_dir)
    finally:
        server.stop()
    g0, g1 = off["groups"], on["groups"]
    summary = {
        "workers_per_group": {"off": g0["workers_per_group"], "on": g1["workers_per_group"]},
        "prefill_computed": {"off": g0["prefill_tokens_computed"], "on": g1["prefill_tokens_computed"],
                             "uncached_total": g1["prefill_tokens_uncached"],
                             "reduction_vs_off": round(1 - g1["prefill_tokens_computed"]
                                                       / max(1, g0["prefill_tokens_computed"]), 3)},
        "session_hit_rate_of_best": {"off": off["sessions"]["of_best"], "on": on["sessions"]["of_best"]},
        "groups_wall_ratio": round(g1["wall_s"] / g0["wall_s"], 3),
        "groups_p95_queue_ms": {"off": g0["p95_queue_ms"], "on": g1["p95_queue_ms"]},
        "sessions_wall_ratio": round(on["sessions"]["wall_s"] / off["sessions"]["wall_s"], 3),
        "hot_key_wall_ratio": round(on["hot_key"]["wall_s"] / off["hot_key"]["wall_s"], 3),
        "teacher_forced_max_gap": max(g0["teacher_forced_max_gap"], g1["teacher_forced_max_gap"]),
    }
    return {"config": {k: v for k, v in vars(args).items() if k != "json_out"}, "off": off, "on": on,
            "summary": summary, "logs": str(log_dir)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.affinity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--lanes", type=int, default=16)
    parser.add_argument("--max-inflight", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=192, help="characters (= tokens) of a first prompt")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--prefix-cache-tokens", type=int, default=200_000)
    parser.add_argument("--heartbeat-s", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3, help="runs of the groups and hot-key scenarios (medians)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    emit_json(asyncio.run(run(args)), args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
