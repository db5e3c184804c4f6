"""GRPO that learns, through the queue, on CPU: a trainer and two worker processes.

The trainer holds the tiny model and an Adam optimizer; two ``redroll worker`` processes
(transformers engine) serve it through Redis. Each step:

1. every prompt goes out as a group of ``n`` samples (``submit_group``);
2. the reward of a sample is the share of digits (``0``-``9``) in its completion, a verifiable
   toy reward with an initial hit rate of a few percent;
3. advantages are normalised within each group; the policy-gradient loss uses the trainer's own
   recomputed logprobs; one optimizer step;
4. the new weights are pushed over torch.distributed (gloo) to both workers
   (``producer.weight_sync``), and the next step samples on the new version.

Every step checks that the logprobs in the records (from the workers) match the trainer's
recomputation under the same weights (max absolute difference, which must stay below 1e-4) and
reports staleness. Rewards and parity come from the records received through the queue. It
writes a JSONL log (one line per step) and, when matplotlib is installed, the reward curve as PNG.

    python examples/grpo_learn.py --seeds 0 1 2 --out grpo.jsonl --png docs/grpo_reward.png

Redis is ``REDROLL_REDIS_URL``, else a private redis-server, else the embedded fakeredis.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from redroll.engine_worker.engines.tiny_model import ByteTokenizer, build_tiny_model  # noqa: E402
from redroll.ops.control import live_workers  # noqa: E402
from redroll.producer import Producer  # noqa: E402
from redroll.producer.rollout import staleness_report  # noqa: E402
from redroll.shared.connection import connect  # noqa: E402
from redroll.shared.settings import Settings  # noqa: E402
from redroll.shared.types import CompletionRecord, RecordStatus  # noqa: E402
from redroll.testing.embedded import embedded_redis  # noqa: E402

TARGET = frozenset(b"0123456789")
"""The token ids (bytes) the reward counts."""

PARITY_LIMIT = 1e-4


def reward(ids: list[int]) -> float:
    return sum(t in TARGET for t in ids) / max(1, len(ids))


def sequence_logprobs(model: Any, prompts: list[list[int]], outputs: list[list[int]], temperature: float) -> Any:
    """``log_softmax(logits / T)[token]`` of every output token, one row per sample (right-padded,
    so a causal model's positions are unaffected); a list of 1-D tensors, with grad."""
    seqs = [p + o for p, o in zip(prompts, outputs)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    rows = []
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        positions = torch.arange(len(p) - 1, len(p) + len(o) - 1)
        rows.append(logprobs[i, positions, torch.tensor(o)])
    return rows


async def step_rollout(producer: Producer, step: int, seed: int, args: argparse.Namespace,
                       tok: ByteTokenizer) -> list[list[CompletionRecord]]:
    groups = []
    for i in range(args.prompts):
        prompt = tok.encode(f"Q{seed}.{step}.{i}: count")
        groups.append(await producer.submit_group(
            args.samples, group_id=f"s{seed}-t{step:03d}-p{i}", input_ids=prompt, return_logprob=True,
            sampling_params={"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                             "ignore_eos": True, "sampling_seed": (seed * 1_000_003 + step * 1009 + i) * 64}))
    outcomes = await asyncio.gather(*(g.take(args.samples, timeout=300) for g in groups))
    out = []
    for outcome in outcomes:
        if len(outcome.accepted) != args.samples:
            raise RuntimeError(f"a group came back incomplete: {outcome}")
        out.append(sorted(outcome.accepted, key=lambda r: r.request_id))
    return out


async def train(settings: Settings, args: argparse.Namespace, seed: int, log: Any) -> list[dict]:
    tok = ByteTokenizer()
    model = build_tiny_model(seed)  # the workers start on tiny-random; the first push brings these
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    history: list[dict] = []
    async with Producer(settings) as producer, producer.weight_sync(timeout_s=60) as sync:
        version = 1
        await sync.push(model.named_parameters(), version=str(version))
        for step in range(1, args.steps + 1):
            t0 = time.monotonic()
            groups = await step_rollout(producer, step, seed, args, tok)
            gen_s = time.monotonic() - t0
            records = [r for g in groups for r in g]
            assert all(r.status is RecordStatus.FINISHED for r in records)
            prompts = [tok.encode(f"Q{seed}.{step}.{i}: count") for i, g in enumerate(groups) for _ in g]
            outputs = [r.output_token_ids[0] for r in records]
            rewards = [reward(o) for o in outputs]
            # Parity: the engine's logprobs against the trainer's, same weights (this version).
            logprobs = sequence_logprobs(model, prompts, outputs, args.temperature)
            on_version = [r.meta_info["weight_version"] == str(version) for r in records]
            parity = max(float((lp.detach() - torch.tensor(r.output_logprobs[0])).abs().max())
                         for lp, r, on in zip(logprobs, records, on_version) if on)
            # Group-normalised advantages and the policy-gradient loss.
            advantages = []
            for g in range(len(groups)):
                rs = rewards[g * args.samples:(g + 1) * args.samples]
                mean, std = statistics.fmean(rs), statistics.pstdev(rs)
                advantages += [(x - mean) / (std + 1e-6) if std > 0 else 0.0 for x in rs]
            loss = -sum(a * lp.mean() for a, lp in zip(advantages, logprobs)) / len(records)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            t1 = time.monotonic()
            version += 1
            report = await sync.push(model.named_parameters(), version=str(version))
            push_s = time.monotonic() - t1
            row = {"seed": seed, "step": step, "version": version - 1, "mean_reward": statistics.fmean(rewards),
                   "hit_rate": statistics.fmean(rewards), "parity_max_abs": parity,
                   "on_version": sum(on_version), "samples": len(records),
                   "staleness": staleness_report(records, current_version=version - 1),
                   "loss": float(loss.detach()), "generate_s": round(gen_s, 3), "push_s": round(push_s, 3),
                   "push_workers": len(report.workers), "workers": sorted({r.worker for r in records})}
            history.append(row)
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(f"seed {seed} step {step:3d}: reward {row['mean_reward']:.3f} parity {parity:.2e} "
                  f"gen {gen_s:.2f}s push {push_s:.2f}s", file=sys.stderr)
            if parity >= PARITY_LIMIT:
                raise AssertionError(f"step {step}: the engine's logprobs differ from the trainer's by {parity:.2e}")
    return history


def summary(history: list[dict], window: int = 5) -> dict:
    first = statistics.fmean(h["mean_reward"] for h in history[:window])
    last = statistics.fmean(h["mean_reward"] for h in history[-window:])
    return {"first5": round(first, 4), "last5": round(last, 4), "gain": round(last - first, 4),
            "parity_max_abs": max(h["parity_max_abs"] for h in history),
            "push_s_median": statistics.median(h["push_s"] for h in history),
            "generate_s_median": statistics.median(h["generate_s"] for h in history),
            "max_staleness": max(h["staleness"].get("max", 0) for h in history)}


def plot(histories: dict[int, list[dict]], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    for seed, history in histories.items():
        ax.plot([h["step"] for h in history], [h["mean_reward"] for h in history], marker=".", label=f"seed {seed}")
    ax.set_xlabel("step (one optimizer step and one weight push each)")
    ax.set_ylabel("mean reward (share of digits)")
    ax.set_title("GRPO through redroll: trainer + 2 worker processes, CPU")
    ax.set_ylim(0, 1)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return True


def start_workers(settings: Settings, count: int) -> list[subprocess.Popen]:
    env = dict(os.environ, REDROLL_REDIS_URL=settings.redis_url, REDROLL_NAMESPACE=settings.namespace,
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    return [subprocess.Popen([sys.executable, "-m", "redroll.cli", "worker", "--engine", "transformers",
                              "--model-path", "tiny-random", "--max-inflight", "64", "--max-batch-size", "64"],
                             cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _ in range(count)]


async def wait_for_workers(settings: Settings, count: int, timeout: float = 120) -> None:
    r = connect(settings)
    try:
        deadline = time.monotonic() + timeout
        while len(await live_workers(r, settings.keys)) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{count} workers did not start within {timeout:.0f}s")
            await asyncio.sleep(0.2)
    finally:
        await r.aclose()


async def run(settings: Settings, args: argparse.Namespace) -> dict[int, list[dict]]:
    procs = start_workers(settings, args.workers)
    histories: dict[int, list[dict]] = {}
    try:
        await wait_for_workers(settings, args.workers)
        with open(args.out, "w", encoding="utf-8") as log:
            for seed in args.seeds:
                histories[seed] = await train(settings, args, seed, log)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    return histories


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=8, help="groups per step")
    p.add_argument("--samples", type=int, default=8, help="samples per group")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (1e-2 saturates the reward within 3 steps)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", default="grpo.jsonl")
    p.add_argument("--png", default=None, help="write the reward curve here (needs matplotlib)")
    p.add_argument("--min-gain", type=float, default=0.3,
                   help="exit 1 unless the mean reward of the last 5 steps beats the first 5 by this much")
    args = p.parse_args(argv)
    started = time.monotonic()
    with embedded_redis() as (url, how):
        print(f"redis: {how}", file=sys.stderr)
        settings = Settings.from_env(redis_url=url, namespace=f"grpo-learn-{os.getpid()}")
        histories = asyncio.run(run(settings, args))
    result = {"seeds": {seed: summary(h) for seed, h in histories.items()},
              "seconds": round(time.monotonic() - started, 1), "steps": args.steps,
              "samples_per_step": args.prompts * args.samples}
    if args.png:
        result["png"] = args.png if plot(histories, args.png) else None
    print(json.dumps(result, indent=2))
    learned = all(s["gain"] >= args.min_gain and s["parity_max_abs"] < PARITY_LIMIT for s in result["seeds"].values())
    return 0 if learned else 1


if __name__ == "__main__":
    sys.exit(main())
