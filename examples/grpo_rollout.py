"""A GRPO-style rollout loop over the queue, on CPU with the tiny model.

64 prompts x 8 samples per step. Each prompt is a group; a group keeps the first 6 finished
samples (the 2 stragglers are aborted and reported, not lost) and is used only if its rewards
differ (dynamic sampling: a group whose samples all score the same teaches GRPO nothing). Halfway
through, the trainer publishes new weights: workers switch at a single point, records say which
version made them, and the staleness of the batch is reported. Results go to a JSONL file.

    python examples/grpo_rollout.py --out rollouts.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from redroll.engine_worker.engines import create_engine  # noqa: E402
from redroll.engine_worker.engines.tiny_model import ByteTokenizer  # noqa: E402
from redroll.engine_worker.worker import Worker  # noqa: E402
from redroll.producer import Producer  # noqa: E402
from redroll.producer.rollout import staleness_report  # noqa: E402
from redroll.shared.settings import Settings  # noqa: E402
from redroll.shared.types import CompletionRecord  # noqa: E402
from redroll.testing.embedded import embedded_redis  # noqa: E402


def reward(record: CompletionRecord) -> float:
    """A toy verifiable reward: the share of vowels in the decoded completion."""
    text = ByteTokenizer().decode(record.output_token_ids[0])
    return sum(c in "aeiouAEIOU" for c in text) / max(1, len(text))


async def rollout(settings: Settings, args: argparse.Namespace) -> dict:
    workers = [Worker(settings, create_engine("transformers", model_path="tiny-random", max_batch_size=64),
                      max_inflight=64, block_ms=200) for _ in range(args.workers)]
    tasks = [asyncio.create_task(w.run()) for w in workers]
    tok = ByteTokenizer()
    prompts = [f"Question {i}: what is {i} plus {i * 3}?" for i in range(args.prompts)]
    out = open(args.out, "w", encoding="utf-8")
    stats = {"groups": 0, "groups_used": 0, "accepted": 0, "aborted": 0, "rejected": 0, "surplus": 0, "failed": 0}
    used_records: list[CompletionRecord] = []
    started = time.monotonic()
    try:
        async with Producer(settings, max_inflight=args.max_inflight) as producer:
            async def one_group(i: int) -> None:
                group = await producer.submit_group(
                    args.samples, group_id=f"step0-p{i:03d}", input_ids=tok.encode(prompts[i]), return_logprob=True,
                    meta_info={"prompt_index": i},
                    sampling_params={"max_new_tokens": args.max_new_tokens, "temperature": 1.0, "sampling_seed": 1000 * i})
                outcome = await group.take(args.keep, timeout=600)
                rewards = [reward(r) for r in outcome.accepted]
                used = len(outcome.accepted) == args.keep and statistics.pvariance(rewards) > 0
                stats["groups"] += 1
                stats["groups_used"] += used
                for name in ("accepted", "aborted", "rejected", "surplus", "failed"):
                    stats[name] += len(getattr(outcome, name))
                mean = statistics.fmean(rewards) if rewards else 0.0
                for rec, rew in zip(outcome.accepted, rewards):
                    out.write(json.dumps({
                        "group_id": group.group_id, "request_id": rec.request_id, "used": used,
                        "reward": rew, "advantage": rew - mean, "output_token_ids": rec.output_token_ids[0],
                        "output_logprobs": rec.output_logprobs[0], "finish_reason": rec.finish_reasons[0],
                        "weight_version": rec.meta_info["weight_version"], "worker": rec.worker}) + "\n")
                for rec in outcome.aborted:
                    out.write(json.dumps({"group_id": group.group_id, "request_id": rec.request_id,
                                          "status": "aborted", "used": False}) + "\n")
                if used:
                    used_records.extend(outcome.accepted)

            first = [asyncio.create_task(one_group(i)) for i in range(args.prompts // 2)]
            await asyncio.gather(*first)
            # The trainer took a step: publish new weights; the fleet switches before the rest.
            await producer.update_weights("tiny-random:1", "1", timeout=120)
            await asyncio.gather(*(one_group(i) for i in range(args.prompts // 2, args.prompts)))
            stats["staleness"] = staleness_report(used_records, current_version=producer.weight_version)
    finally:
        out.close()
        for w in workers:
            w.request_stop()
        await asyncio.gather(*tasks)
    stats["seconds"] = round(time.monotonic() - started, 2)
    stats["versions"] = sorted({r.meta_info["weight_version"] for r in used_records})
    return stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--keep", type=int, default=6, help="samples kept per group; the stragglers are aborted")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--max-inflight", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", default="rollouts.jsonl")
    args = p.parse_args(argv)
    with embedded_redis() as (url, how):
        print(f"redis: {how}", file=sys.stderr)
        stats = asyncio.run(rollout(Settings.from_env(redis_url=url, namespace="grpo-example"), args))
    print(json.dumps(stats, indent=2))
    expected = args.prompts * args.samples
    accounted = sum(stats[k] for k in ("accepted", "aborted", "rejected", "surplus", "failed"))
    return 0 if accounted == expected else 1


if __name__ == "__main__":
    sys.exit(main())
