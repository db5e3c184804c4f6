"""The transformers engine's sampling: one token per row with its logprob, prompt logprobs, seeds
(see :mod:`.transformers_engine` for what the logprob is)."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from redroll.engine_worker.engines.transformers_batch import _Row, _Sampling
from redroll.shared.types import SamplingParams

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


def _top_k(rows: list[_Row]) -> int:
    return max((row.job.request.top_logprobs_num for row in rows), default=0)


def _prompt_logprobs(logits: "torch.Tensor", prompt: list[int], temperature: "torch.Tensor",
                     start: int) -> list[float | None]:
    """The logprob of each prompt token from ``start`` on under ``softmax(logits / T)`` of the
    position before it (the prompt is right-aligned in ``logits`` [width, vocab]); the first
    token has none."""
    import torch

    t = float(temperature) if float(temperature) > 0 else 1.0
    width = logits.shape[0]
    first = width - len(prompt)
    scaled = torch.log_softmax(logits[first:width - 1] / t, dim=-1)
    targets = torch.tensor(prompt[1:], dtype=torch.long, device=logits.device)
    values = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist()
    return ([None] + values)[start:]


def _sample(
    logits: "torch.Tensor", sampling: _Sampling, active: list[bool], banned: list[tuple[int, int]],
    top_logprobs: int = 0, allowed: "torch.Tensor | None" = None,
) -> tuple[list[int], list[float], list[list[tuple[int, float]]] | None]:
    """One token per row, and its logprob under ``softmax(logits / T)`` before any filtering (and
    the ``top_logprobs`` most likely tokens of that distribution). ``allowed`` (``[rows, vocab]``
    bools): the tokens each row's grammar allows; the others are masked before the draw, after
    the logprobs (which stay the model's).

    Rows are independent: a row's draw depends only on its logits and its own generator, which
    is advanced once per step the row is active and sampling. Greedy rows (T == 0) take the argmax.
    """
    import torch

    if allowed is None:
        allowed = sampling.allowed
    temperature = sampling.temperature
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(-1)
    logprobs = torch.log_softmax(scaled, dim=-1)

    masked = scaled
    if banned or allowed is not None:
        masked = scaled.clone()
    if banned:
        index = torch.tensor(banned, dtype=torch.long, device=logits.device)
        masked[index[:, 0], index[:, 1]] = float("-inf")
    if allowed is not None:
        width = min(masked.shape[-1], allowed.shape[-1])
        masked[:, :width].masked_fill_(~allowed[:, :width].to(logits.device), float("-inf"))
        masked[:, width:] = float("-inf")

    uniforms = torch.zeros(len(active), dtype=torch.float32, device=logits.device)
    for i, (gen, on, is_greedy) in enumerate(zip(sampling.generators, active, greedy.tolist())):
        if on and not is_greedy:
            uniforms[i] = torch.rand((), generator=gen, device=logits.device)
    tokens = torch.where(greedy, masked.argmax(dim=-1), _filtered_draw(masked, sampling, uniforms))
    chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    tops = None
    if top_logprobs:
        values, ids = logprobs.topk(top_logprobs, dim=-1)
        tops = [list(zip(row_ids, row_values)) for row_ids, row_values in zip(ids.tolist(), values.tolist())]
    return tokens.tolist(), chosen.tolist(), tops


def _filtered_draw(masked: "torch.Tensor", sampling: _Sampling, uniforms: "torch.Tensor") -> "torch.Tensor":
    """Inverse-CDF draw after SGLang-style top-k, top-p and min-p filtering (all from the same probs)."""
    import torch

    probs = torch.softmax(masked, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
    top_p = sampling.top_p.unsqueeze(-1)
    drop = ((sorted_probs.cumsum(dim=-1) - sorted_probs) > top_p) & (top_p < 1.0)
    drop |= ranks >= sampling.top_k.unsqueeze(-1)
    drop |= sorted_probs < sorted_probs[:, :1] * sampling.min_p.unsqueeze(-1)
    drop[:, 0] = False  # the most likely token always survives
    kept = sorted_probs.masked_fill(drop, 0.0)
    cdf = kept.cumsum(dim=-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(-1)
    position = torch.searchsorted(cdf, target, right=True)
    last_kept = (kept > 0).sum(dim=-1, keepdim=True) - 1
    position = torch.minimum(position, last_kept.clamp_min(0))
    return order.gather(-1, position).squeeze(-1)


def _row_seed(params: SamplingParams, index: int) -> int:
    """``sampling_seed + index`` when a seed is given (reproducible, distinct per sample), else random."""
    if params.sampling_seed is None:
        return secrets.randbits(63)
    return params.sampling_seed + index
