"""A tiny, randomly initialised causal LM and a byte-level tokenizer, built in code.

Used where no model can be downloaded (tests, CPU smoke runs): ``build_tiny_model(seed)`` gives
bit-identical weights in every process for the same seed, so a test in another process can
recompute logprobs with :func:`teacher_forced_logprobs`.

torch and transformers are imported lazily, so :class:`ByteTokenizer` works without them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch
    from transformers import LlamaForCausalLM

TINY_RANDOM = "tiny-random"
"""The model path that selects the tiny random model instead of a Hugging Face directory."""

BYTE_VOCAB = 256
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
TINY_VOCAB_SIZE = 259
_SPECIAL_NAMES = {BOS_ID: "<bos>", EOS_ID: "<eos>", PAD_ID: "<pad>"}

# Architecture of the tiny model.
_HIDDEN = 64
_INTERMEDIATE = 128
_LAYERS = 2
_HEADS = 4
_KV_HEADS = 2
_MAX_POSITIONS = 2048

# Init scales. The logit scale makes next-token distributions peaky (a few likely bytes per
# context; entropy ~2.6 nats vs 5.6 uniform); the eos weight makes eos reachable but rare
# (about 3% per step at T = 1, see _add_eos_bias).
_LOGIT_STD = 3.0
_BIAS_CHANNEL_VALUE = 4.0
_EOS_LOGIT_WEIGHT = 0.6


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then ``bos`` (256), ``eos`` (257) and ``pad`` (258)."""

    bos_token_id: int = BOS_ID
    eos_token_id: int = EOS_ID
    pad_token_id: int = PAD_ID
    vocab_size: int = TINY_VOCAB_SIZE

    @property
    def all_special_ids(self) -> list[int]:
        return [self.bos_token_id, self.eos_token_id, self.pad_token_id]

    chat_template = None
    """No chat template: chats are refused on the built-in tiny model (naming ``messages``)."""

    def __len__(self) -> int:
        return self.vocab_size

    def apply_chat_template(self, conversation: list, **kwargs: object) -> list[int]:
        raise ValueError("the built-in tiny model has no chat template")

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """The UTF-8 bytes of ``text``, preceded by bos when ``add_bos``."""
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Bytes back to text (invalid UTF-8 becomes U+FFFD); special tokens dropped or spelled out."""
        out = bytearray()
        for token in ids:
            if 0 <= token < BYTE_VOCAB:
                out.append(token)
            elif not skip_special_tokens:
                out.extend(_SPECIAL_NAMES.get(token, f"<unk:{token}>").encode())
        return out.decode("utf-8", errors="replace")


def build_tiny_model(seed: int = 0) -> "LlamaForCausalLM":
    """A 2-layer Llama (hidden 64, vocab 259) with weights drawn deterministically from ``seed``.

    The global torch RNG is left as it was. float32, eager attention, eval mode.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=_HIDDEN, intermediate_size=_INTERMEDIATE, num_hidden_layers=_LAYERS,
        num_attention_heads=_HEADS, num_key_value_heads=_KV_HEADS, max_position_embeddings=_MAX_POSITIONS,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, tie_word_embeddings=False,
        attn_implementation="eager")
    # transformers draws its own init from the global RNG: keep that from leaking out, then
    # overwrite every parameter from a private generator so the weights depend on `seed` only.
    with torch.random.fork_rng(devices=[]):
        model = LlamaForCausalLM(config)
    _init_weights(model, seed)
    return model.to(torch.float32).eval()


def _init_weights(model: "LlamaForCausalLM", seed: int) -> None:
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:  # RMSNorm weights
                param.fill_(1.0)
            elif name.endswith("embed_tokens.weight"):
                param.normal_(0.0, 1.0, generator=generator)
            elif name.endswith("lm_head.weight"):
                param.normal_(0.0, _LOGIT_STD / math.sqrt(param.shape[1]), generator=generator)
            else:  # linear layers: unit-variance outputs, so attention and the MLP matter
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[1]), generator=generator)
        _add_eos_bias(model)


def _add_eos_bias(model: "LlamaForCausalLM") -> None:
    """Give eos a steady logit bias, so that it is reachable but rare.

    Llama's lm_head has no bias term, so hidden channel 0 serves as one: every embedding gets a
    large constant there (it stays positive through the two layers), and only the eos row of
    lm_head reads it.
    """
    model.model.embed_tokens.weight[:, 0] = _BIAS_CHANNEL_VALUE
    model.lm_head.weight[:, 0] = 0.0
    model.lm_head.weight[EOS_ID, 0] = _EOS_LOGIT_WEIGHT


def teacher_forced_logprobs(
    model: "torch.nn.Module",
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    temperature: float,
) -> list[float]:
    """``log_softmax(logits / T)[token]`` for each output token, from one unpadded forward pass.

    ``T == 0`` is read as ``T = 1`` (the engine's logprob convention for greedy decoding).
    """
    import torch

    if not output_ids:
        return []
    scale = temperature if temperature > 0 else 1.0
    ids = torch.tensor([list(prompt_ids) + list(output_ids)], dtype=torch.long, device=_device_of(model))
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
    start = len(prompt_ids) - 1
    predicting = logits[start : start + len(output_ids)] / scale
    logprobs = torch.log_softmax(predicting, dim=-1)
    targets = ids[0, len(prompt_ids) :].unsqueeze(-1)
    return logprobs.gather(-1, targets).squeeze(-1).tolist()


def _device_of(model: "torch.nn.Module") -> "torch.device":
    return next(model.parameters()).device


__all__ = [
    "BOS_ID",
    "ByteTokenizer",
    "EOS_ID",
    "PAD_ID",
    "TINY_RANDOM",
    "TINY_VOCAB_SIZE",
    "build_tiny_model",
    "teacher_forced_logprobs",
]
