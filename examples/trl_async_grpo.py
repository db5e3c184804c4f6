"""TRL's async GRPO through redroll, on CPU: rollouts through ``redroll serve`` (``/v1/completions``),
weights through ``weight_transfer=RedrollWeightTransfer()``.

TRL's ``AsyncGRPOTrainer`` (``trl.experimental.async_grpo``, TRL 1.16) samples from an
OpenAI-compatible server with a rollout process of its own and hands every weight sync to the
``weight_transfer`` object it is given. Here the server is the gateway in front of a redroll fleet,
and the transfer pushes the trainer's weights to every worker of that fleet (version = the
trainer's ``model_version``). After training, this example asks the fleet for a few completions
through the Python API and checks that their logprobs are the trained model's own (teacher-forced,
within 1e-4) and that every record carries the last pushed version.

    python examples/trl_grpo.py build-model tiny-policy
    redroll worker --engine transformers --model-path tiny-policy &    # (REDROLL_* settings)
    redroll serve --port 8000 &
    python examples/trl_async_grpo.py --model tiny-policy --base-url http://127.0.0.1:8000 --out async.json

TRL 1.16's async GRPO is written for GPUs; on CPU it needs the three shims in :func:`cpu_shims`, none
of which touches weight transfer or rollouts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from trl_grpo import PROMPTS, x_share  # noqa: E402  (module-level: the rollout process unpickles it)

PARITY_LIMIT = 1e-4


class _VarlenAttention:
    """flash-attn's ``flash_attn_varlen_func`` in plain torch (SDPA per segment, causal aligned to
    the bottom right as flash-attn aligns it), for CPU."""

    @staticmethod
    def flash_attn_varlen_func(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, _max_q: Any, _max_k: Any,
                               softmax_scale: float | None = None, causal: bool = True, **_: Any) -> Any:
        import torch

        out = torch.empty_like(q)
        for s in range(len(cu_q) - 1):
            qa, qb, ka, kb = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
            qs, ks, vs = q[qa:qb], k[ka:kb], v[ka:kb]
            if ks.shape[1] != qs.shape[1]:  # grouped-query attention
                ks = ks.repeat_interleave(qs.shape[1] // ks.shape[1], 1)
                vs = vs.repeat_interleave(qs.shape[1] // vs.shape[1], 1)
            rows, cols = torch.arange(qb - qa).unsqueeze(1), torch.arange(kb - ka).unsqueeze(0)
            mask = cols <= rows + (kb - ka) - (qb - qa) if causal else None
            o = torch.nn.functional.scaled_dot_product_attention(
                qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), attn_mask=mask, scale=softmax_scale)
            out[qa:qb] = o.transpose(0, 1)
        return out


def cpu_shims() -> None:
    """What TRL 1.16's async GRPO lacks on a machine without a GPU, patched where it is looked up.

    1. Its tree attention calls a flash-attn 3 kernel fetched from the Hugging Face Hub
       (``packing._flash_attn``: ``kernels.get_kernel("kernels-community/flash-attn3")``, CUDA only):
       a plain-torch ``flash_attn_varlen_func`` instead (the packing itself is TRL's, unchanged).
    2. ``AsyncGRPOTrainer.__init__`` asks ``torch.cuda.get_device_name`` for the peak FLOPs it logs
       (``get_peak_flops_per_device``): none here.
    3. ``AsyncRolloutWorker.__init__`` refuses to start without vLLM installed (``is_vllm_available``),
       though its rollout process speaks HTTP with aiohttp only.
    """
    import trl.experimental.async_grpo.async_grpo_trainer as trainer_module
    import trl.experimental.async_grpo.async_rollout_worker as rollout_module
    import trl.experimental.async_grpo.packing as packing

    packing._flash_attn = lambda: _VarlenAttention
    trainer_module.get_peak_flops_per_device = lambda *a, **k: None
    rollout_module.is_vllm_available = lambda *a, **k: True


RESPONSE_TEMPLATE = {"defaults": {"role": "assistant"}, "start_anchor": "<|assistant|>",
                     "fields": {"content": {"close_pattern": r"\s*<eos>\s*|$", "content": "text"}}}
"""How an assistant turn of the tiny chat template reads back (TRL's rollout process parses each
completion with the tokenizer's response template; transformers knows the templates of real models,
not this one)."""


def train(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from redroll.integrations.trl import RedrollWeightTransfer

    cpu_shims()
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.response_template = RESPONSE_TEMPLATE
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    config = AsyncGRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-async-"), use_cpu=True, bf16=False, gradient_checkpointing=False,
        report_to="none", save_strategy="no", disable_tqdm=True, max_steps=args.steps, learning_rate=args.lr,
        per_device_train_batch_size=8, num_generations=4, max_completion_length=12, top_k=args.top_k,
        vllm_server_base_url=args.base_url, token_budget=args.token_budget, max_staleness=1, queue_maxsize=16,
        seed=args.seed)
    transfer = RedrollWeightTransfer()
    calls: list[str] = []
    for method in ("init_weight_transfer", "pause", "send_weights", "resume", "destroy"):
        original = getattr(transfer, method)
        setattr(transfer, method, _recorded(calls, method, original))
    trainer = AsyncGRPOTrainer(model=args.model, reward_funcs=x_share, args=config, train_dataset=dataset,
                               processing_class=tokenizer, weight_transfer=transfer)
    started = time.monotonic()
    trainer.train()
    report = {"steps": trainer.state.global_step, "model_version": trainer.model_version, "calls": calls,
              "pushed": [int(r.version) for r in transfer.reports],
              "push_workers": [len(r.workers) for r in transfer.reports],
              "rewards": [h["reward"] for h in trainer.state.log_history if "reward" in h],
              "seconds": round(time.monotonic() - started, 2)}
    report.update(served_check(args.model, trainer.model, tokenizer, transfer.version))
    return report


def _recorded(calls: list[str], name: str, method: Any) -> Any:
    def call(*a: Any) -> Any:
        calls.append(name)
        return method(*a)

    return call


def served_check(model_dir: str, trained: Any, tokenizer: Any, version: int) -> dict[str, Any]:
    """A few completions from the fleet, through the Python API: their version, and their logprobs
    against the trained model's own (an eager-attention copy of it: TRL's tree attention needs packed rows)."""
    from transformers import AutoModelForCausalLM

    from redroll.engine_worker.engines.tiny_model import teacher_forced_logprobs
    from redroll.producer.sync import SyncProducer

    reference = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    reference.load_state_dict(trained.state_dict())
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for p in PROMPTS[:4]]
    with SyncProducer() as producer:
        futures = producer.submit_many([{"input_ids": ids, "return_logprob": True,
                                         "sampling_params": {"max_new_tokens": 12}} for ids in prompts])
        records = [f.result(120) for f in futures]
    worst = max(max(abs(a - b) for a, b in zip(teacher_forced_logprobs(reference, ids, rec.output_token_ids[0], 1.0),
                                               rec.output_logprobs[0]))
                for ids, rec in zip(prompts, records))
    return {"served_versions": sorted({rec.meta_info["weight_version"] for rec in records}),
            "served_parity_max_abs": worst, "last_push": version}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the directory `examples/trl_grpo.py build-model` wrote")
    p.add_argument("--base-url", required=True, help="redroll serve's URL (without /v1)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top-k", type=int, default=0, help="GRPOConfig.top_k (0: off, as TRL and vLLM mean it)")
    p.add_argument("--token-budget", type=int, default=None,
                   help="tokens per packed row (default: the server's max_model_len, from /v1/models)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    report = train(args)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    ok = report["served_versions"] == [str(report["last_push"])] and report["served_parity_max_abs"] < PARITY_LIMIT
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
