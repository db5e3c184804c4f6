"""The transformers engine's bookkeeping: a request (job) as rows in a batch, and the tensors a
batch carries from step to step (see :mod:`.transformers_engine`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from redroll.engine_worker.engines.base import EngineOutput
from redroll.engine_worker.engines.prefix_cache import KV
from redroll.shared.types import GenerationRequest, SamplingParams

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


@dataclass(eq=False)
class _Row:
    """One sample of one request inside a running batch."""

    job: "_Job"
    index: int
    seed: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    """The weight version that produced each token (an in-place update swaps between two steps)."""
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    """Per token, the most likely tokens and their logprobs (``top_logprobs_num``)."""
    finish_reason: str | None = None
    grammar: Any = None
    """The row's :class:`~.grammar.Grammar` (structured output), or None."""

    @property
    def params(self) -> SamplingParams:
        return self.job.request.sampling_params

    @property
    def active(self) -> bool:
        return self.finish_reason is None and not self.job.future.done()


@dataclass(eq=False)
class _Job:
    """One generate() call: queued, then running as ``n`` rows, then resolved."""

    request: GenerationRequest
    handle: str
    prompt_ids: list[int]
    future: asyncio.Future[EngineOutput]
    rows: list[_Row] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    cached_tokens: int = 0
    """Prompt tokens whose KV this request did not compute: a prefix cache hit, or the whole prompt
    when an earlier request of its batch had the same prompt (that one's prefill served both)."""

    @property
    def width(self) -> int:
        return self.request.sampling_params.n


@dataclass
class _Sampling:
    """Per-row sampling settings of a batch, as tensors on the model's device."""

    temperature: "torch.Tensor"  # [B], 0 = greedy
    top_k: "torch.Tensor"  # [B], vocab size when off
    top_p: "torch.Tensor"  # [B]
    min_p: "torch.Tensor"  # [B]
    generators: list["torch.Generator"]
    top_logprobs: int = 0
    """The largest ``top_logprobs_num`` of the batch (0: none asked)."""
    allowed: Any = None
    """``[rows, vocab]`` bools for the next step: the tokens each row's grammar allows (None: no
    grammar in the batch); set before every step."""


@dataclass
class _Decoder:
    """The tensors one batch carries from step to step."""

    cache: Any
    attention_mask: "torch.Tensor"  # [B, seen]
    next_position: "torch.Tensor"  # [B]
    width: int = 0
    """Prefill width: row i's prompt sits at cache positions ``width - len(prompt) .. width - 1``, its
    j-th generated token (from 0) at ``width + j``."""


@dataclass(eq=False)
class _Prefill:
    """One distinct prompt of a batch with the prefix cache on: prefilled once for all its rows."""

    prompt: tuple[int, ...]
    rows: list[int]
    """The batch rows with this prompt."""
    cached: int = 0
    """Leading prompt tokens whose KV comes from the prefix cache (``past``)."""
    past: KV | None = None
    all_logits: bool = False
    """A row wants prompt logprobs: no cache lookup, every position's logits."""
    kv: KV | None = None
    """Set by the prefill: the whole prompt's KV (``[1, heads, len, head_dim]`` per layer)."""
