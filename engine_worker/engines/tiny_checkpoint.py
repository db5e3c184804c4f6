"""A tiny Llama checkpoint on disk, built in code: what a real engine (vLLM) loads in tests.

``save_tiny_checkpoint(directory, seed)`` writes a Hugging Face model directory that any engine
reading ``config.json`` + ``model.safetensors`` + a ``tokenizer.json`` can serve: a 2-layer Llama
(hidden 128, float32) and a byte-level BPE tokenizer trained here with the ``tokenizers`` library
(no download), saved as a ``PreTrainedTokenizerFast``. The model's vocabulary is the tokenizer's,
so every id the tokenizer makes is one the model knows. The same ``seed`` gives the same weights
in every process, so a test can recompute teacher-forced logprobs with transformers
(:func:`load_tiny_checkpoint` + :func:`redroll.engine_worker.engines.tiny_model.teacher_forced_logprobs`).

    python -m redroll.engine_worker.engines.tiny_checkpoint DIR [--seed N]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import LlamaForCausalLM

HIDDEN = 128
INTERMEDIATE = 256
LAYERS = 2
HEADS = 4  # head size 32: one vLLM's CPU attention supports
KV_HEADS = 2
MAX_POSITIONS = 2048
VOCAB_TARGET = 512
SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>")

TINY_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('the first turn must not be the "
    "assistant\\'s') }}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] or '' }}\n{% endfor %}"
    "{% if tools %}<|tools|>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}\n{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""A small chat template (Jinja, as Hugging Face tokenizers carry them) for chat tests; it refuses
a chat that opens with the assistant, as real templates refuse turns out of order:
``save_tiny_checkpoint(..., chat_template=TINY_CHAT_TEMPLATE)``."""

_TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog. A queue of requests waits for a worker; the worker "
    "generates tokens and publishes a record. Rollouts feed a trainer, the trainer pushes weights, "
    "and the fleet goes on. Hello, world! 0123456789 + - * / = ( ) [ ] { } < > ? : ; ' \" ` ~ # $ % & @ ^ | \\ "
    "Grüße, café, naïve, 東京, 😀 — unicode travels as bytes.\n"
)


def _train_tokenizer() -> Any:
    """A byte-level BPE tokenizer (every byte is a token, then merges up to ``VOCAB_TARGET``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_TARGET, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_TRAINING_TEXT] * 20, trainer=trainer)
    return tok


def build_tiny_llama(vocab_size: int, bos: int, eos: int, pad: int, seed: int) -> "LlamaForCausalLM":
    """The model of the checkpoint, float32, weights drawn from ``seed`` only."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=MAX_POSITIONS, bos_token_id=bos, eos_token_id=eos,
                         pad_token_id=pad, tie_word_embeddings=False, torch_dtype="float32")
    with torch.random.fork_rng(devices=[]):
        model = LlamaForCausalLM(config)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.fill_(1.0)
            elif name.endswith("embed_tokens.weight"):
                param.normal_(0.0, 1.0, generator=generator)
            elif name.endswith("lm_head.weight"):
                param.normal_(0.0, 3.0 / math.sqrt(param.shape[1]), generator=generator)
            else:
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[1]), generator=generator)
        # eos reachable but rare (hidden channel 0 serves as a bias, as in tiny_model.py)
        model.model.embed_tokens.weight[:, 0] = 4.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[eos, 0] = 0.6
    return model.to(torch.float32).eval()


def save_tiny_checkpoint(directory: str | Path, seed: int = 0, *, chat_template: str | None = None) -> Path:
    """Write the checkpoint into ``directory`` (created); returns it. Idempotent for one seed.
    ``chat_template``: the tokenizer's (none by default: chat requests are then refused)."""
    from transformers import PreTrainedTokenizerFast

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=_train_tokenizer(), bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    model = build_tiny_llama(len(tokenizer), *ids, seed=seed)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "redroll-tiny.json").write_text(json.dumps({"seed": seed}))
    return out


def load_tiny_checkpoint(directory: str | Path) -> "LlamaForCausalLM":
    """The checkpoint's model with transformers, float32, eager attention (for teacher forcing)."""
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(directory), torch_dtype=torch.float32,
                                            attn_implementation="eager").eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write the tiny test checkpoint (Llama + BPE tokenizer)")
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(save_tiny_checkpoint(args.directory, args.seed))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
