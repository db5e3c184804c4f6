"""TRL's GRPOTrainer learns through redroll, on CPU: ``rollout_func=RedrollRollout()``.

A tiny Llama (tied embeddings) with a word-level tokenizer and a chat template is built in code;
``redroll worker --engine transformers`` processes serve it from its directory. TRL's own
``GRPOTrainer`` (unmodified, float32) trains it on a toy verifiable reward: the share of
completion tokens among ``x0`` .. ``x29`` (30 of 300 words, about 10% at the start). Every
rollout call pushes the trainer's weights when the step changed and generates on them; this
example checks each call: every record carries weight version = the step, and the trainer's
own teacher-forced logprobs of the completions (logits / temperature) equal the records' within
1e-4.

    python examples/trl_grpo.py build-model tiny-policy                 # the model directory
    redroll worker --engine transformers --model-path tiny-policy &     # (REDROLL_* settings)
    python examples/trl_grpo.py train --model tiny-policy --out run/    # one trainer process
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no examples/trl_grpo.py train --model tiny-policy --out run/   # two (gloo, CPU)
    python examples/trl_grpo.py seeds --seeds 0 1 2                     # all in one: Redis, 2 workers, 3 runs

``train`` writes ``rank<N>.json`` under ``--out`` (each process's checks; rank 0 also the
per-step rewards and a summary) and exits 1 when a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # (TRL warns that rollout_func is experimental)

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
WORDS = [f"x{i}" for i in range(30)] + list("abcdefghijklmnopqrstuvwxyz") + [str(i) for i in range(10)]
WORDS += [f"w{i}" for i in range(300 - len(SPECIALS) - len(WORDS))]
VOCAB = {word: i for i, word in enumerate(SPECIALS + WORDS)}
TARGETS = frozenset(VOCAB[f"x{i}"] for i in range(30))
"""The token ids the reward counts."""
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <eos> {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")
PROMPTS = [f"{a} {b} {c}" for a, b, c in zip("abcdefgh", "ijklmnop", "qrstuvwx")]
PARITY_LIMIT = 1e-4


def build_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece(prefix="##")  # (joins words with spaces)
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>", padding_side="left", chat_template=CHAT_TEMPLATE)


def build_model(seed: int) -> Any:
    """The tiny policy, float32, its weights drawn from ``seed`` only."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         pad_token_id=VOCAB["<pad>"], eos_token_id=VOCAB["<eos>"], bos_token_id=VOCAB["<bos>"],
                         tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(pad_token_id=VOCAB["<pad>"], eos_token_id=VOCAB["<eos>"],
                                               bos_token_id=VOCAB["<bos>"])
    return model


def save_model(directory: str, seed: int = 0) -> None:
    build_model(seed).save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)


def x_share(prompts: list, completions: list, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """The reward: the share of a completion's tokens among the targets."""
    return [sum(t in TARGETS for t in ids) / max(1, len(ids)) for ids in completion_ids]


def checked_rollout_class() -> type:
    from redroll.engine_worker.engines.tiny_model import teacher_forced_logprobs
    from redroll.integrations.trl import RedrollRollout

    class CheckedRollout(RedrollRollout):
        """RedrollRollout, and after each call what it promises: every record generated on the
        weights of this step, their logprobs the trainer model's own (teacher-forced)."""

        def __init__(self, **options: Any):
            super().__init__(**options)
            self.checks: list[dict[str, Any]] = []

        def __call__(self, prompts: list, trainer: Any) -> dict[str, Any]:
            out = super().__call__(prompts, trainer)
            step = trainer.state.global_step
            model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
            worst = 0.0
            for prompt, ids, logprobs in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"]):
                want = teacher_forced_logprobs(model, prompt, ids, trainer.args.temperature)
                worst = max(worst, max(abs(a - b) for a, b in zip(want, logprobs)))
            self.checks.append({"step": step, "rank": trainer.accelerator.process_index, "prompts": len(prompts),
                                "versions": sorted(set(out["weight_version"])), "parity_max_abs": worst,
                                "pushed": int(self.last_push.version) if self.last_push else None,
                                "push_workers": len(self.last_push.workers) if self.last_push else None})
            return out

    return CheckedRollout


def train(args: argparse.Namespace) -> dict[str, Any]:
    """One GRPO run against the fleet of ``REDROLL_*``; returns (and writes) this process's report."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1 if world > 1 else 2)
    rewards: list[dict[str, Any]] = []

    class RewardLog(TrainerCallback):
        def on_log(self, _args: Any, state: Any, _control: Any, logs: dict | None = None, **kw: Any) -> None:
            if state.is_world_process_zero and logs and "reward" in logs:
                rewards.append({"step": state.global_step, "reward": logs["reward"]})

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-"), use_cpu=True,
        bf16=False,  # TRL's default is on (bf16 autocast, on CPU too): float32 here
        gradient_checkpointing=False, learning_rate=args.lr, lr_scheduler_type="constant",
        per_device_train_batch_size=args.batch // world, num_generations=args.generations,
        max_completion_length=args.max_tokens, temperature=args.temperature, max_steps=args.steps,
        logging_steps=1, report_to="none", save_strategy="no", seed=args.seed, disable_tqdm=True,
        ddp_find_unused_parameters=False)
    rollout = checked_rollout_class()()
    trainer = GRPOTrainer(model=build_model(args.seed), reward_funcs=x_share, args=config, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(args.model), rollout_func=rollout,
                          callbacks=[RewardLog()])
    trainer.remove_callback(PrinterCallback)  # (its log lines would mix with this script's output)
    started = time.monotonic()
    try:
        trainer.train()
    finally:
        rollout.close()
    rank = trainer.accelerator.process_index
    report: dict[str, Any] = {"rank": rank, "world": world, "seed": args.seed, "checks": rollout.checks,
                              "seconds": round(time.monotonic() - started, 2)}
    if rank == 0:
        values = [r["reward"] for r in rewards]
        k = min(3, len(values) // 2) or 1
        report.update(rewards=rewards, first=statistics.fmean(values[:k]), last=statistics.fmean(values[-k:]), k=k)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    return report


def failures(report: dict[str, Any]) -> list[str]:
    wrong = []
    for check in report["checks"]:
        if check["versions"] != [check["step"]]:
            wrong.append(f"step {check['step']}: records on versions {check['versions']}")
        if check["parity_max_abs"] >= PARITY_LIMIT:
            wrong.append(f"step {check['step']}: logprobs differ by {check['parity_max_abs']:.2e}")
    return wrong


def seeds(args: argparse.Namespace) -> int:
    """Redis, ``--workers`` worker processes on a fresh model directory, then one run per seed."""
    from redroll.shared.settings import Settings
    from redroll.testing.embedded import embedded_redis

    model_dir = tempfile.mkdtemp(prefix="tiny-policy-")
    save_model(model_dir)
    args.model = model_dir
    results = {}
    with embedded_redis() as (url, how):
        print(f"redis: {how}", file=sys.stderr)
        namespace = f"trl-grpo-{os.getpid()}"
        os.environ.update(REDROLL_REDIS_URL=url, REDROLL_NAMESPACE=namespace)
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        workers = [subprocess.Popen([sys.executable, "-m", "redroll.cli", "worker", "--engine", "transformers",
                                     "--model-path", model_dir, "--max-inflight", "64", "--max-batch-size", "64"],
                                    cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                   for _ in range(args.workers)]
        try:
            wait_for_workers(Settings.from_env(), args.workers)
            for seed in args.seeds:
                args.seed = seed
                report = train(args)
                results[seed] = {"first": round(report["first"], 4), "last": round(report["last"], 4),
                                 "gain": round(report["last"] - report["first"], 4),
                                 "parity_max_abs": max(c["parity_max_abs"] for c in report["checks"]),
                                 "seconds": report["seconds"], "failures": failures(report)}
                print(f"seed {seed}: {json.dumps(results[seed])}", file=sys.stderr)
        finally:
            for w in workers:
                w.terminate()
            for w in workers:
                w.wait(30)
    print(json.dumps({"steps": args.steps, "mean_reward_window": f"first/last {min(3, args.steps // 2)} steps",
                      "seeds": results}, indent=1))
    return 0 if all(r["gain"] > 0 and not r["failures"] for r in results.values()) else 1


def wait_for_workers(settings: Any, count: int, timeout: float = 120.0) -> None:
    import asyncio

    from redroll.ops.control import live_workers
    from redroll.shared.connection import connect

    async def wait() -> None:
        r = connect(settings)
        try:
            deadline = time.monotonic() + timeout
            while len(await live_workers(r, settings.keys)) < count:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{count} workers did not start within {timeout:.0f}s")
                await asyncio.sleep(0.2)
        finally:
            await r.aclose()

    asyncio.run(wait())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build-model", help="write the tiny policy (model + tokenizer) to a directory")
    build.add_argument("directory")
    build.add_argument("--seed", type=int, default=0)
    for name in ("train", "seeds"):
        cmd = sub.add_parser(name)
        cmd.add_argument("--steps", type=int, default=20)
        cmd.add_argument("--lr", type=float, default=5e-3)
        cmd.add_argument("--batch", type=int, default=16, help="completions per step, over all processes")
        cmd.add_argument("--generations", type=int, default=4, help="completions per prompt (num_generations)")
        cmd.add_argument("--max-tokens", type=int, default=12, help="max_completion_length")
        cmd.add_argument("--temperature", type=float, default=1.0)
        cmd.add_argument("--out", default=None, help="write rank<N>.json here")
    sub.choices["train"].add_argument("--model", required=True, help="the directory build-model wrote")
    sub.choices["train"].add_argument("--seed", type=int, default=0)
    sub.choices["seeds"].add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    sub.choices["seeds"].add_argument("--workers", type=int, default=2)
    args = p.parse_args(argv)
    if args.command == "build-model":
        save_model(args.directory, args.seed)
        return 0
    if args.command == "seeds":
        return seeds(args)
    report = train(args)
    wrong = failures(report)
    print(json.dumps({k: v for k, v in report.items() if k != "checks"} | {"failures": wrong}))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
