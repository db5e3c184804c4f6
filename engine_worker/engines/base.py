"""The small protocol every engine adapter implements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from redroll.shared.codec import ValidationError
from redroll.shared.types import GenerationRequest


@dataclass
class SampleOutput:
    """One sample of one request. Returned, it is the worker's: the record takes its lists as they
    are, so an engine gives lists it no longer changes (a fresh or a read-only one)."""

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None
    """"stop", "length", "abort", or None when it never started."""
    weight_versions: list[str] | None = None
    """The weight version of each token, when they were not all made by one (an in-place update)."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per token, the request's ``top_logprobs_num`` most likely (token id, logprob) pairs."""
    routed_experts: Any = None
    """A :class:`redroll.shared.types.RoutedExperts` (``return_routed_experts``)."""


@dataclass
class EngineOutput:
    samples: list[SampleOutput]
    prompt_tokens: int
    cached_tokens: int = 0
    weight_version: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    input_logprobs: list[float | None] | None = None
    """The prompt's logprobs from ``logprob_start_len`` on (the first prompt token has none)."""

    @property
    def aborted(self) -> bool:
        return any(s.finish_reason == "abort" for s in self.samples)


@dataclass
class EngineInfo:
    name: str
    model: str
    vocab_size: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    weight_version: str | None = None
    max_context: int | None = None
    logprob_mode: str = "temperature-scaled, before top-k/top-p"
    weight_ranks: int = 1
    """Ranks this engine takes in a trainer's weight-update group (SGLang: one per tensor-parallel GPU)."""


@runtime_checkable
class Engine(Protocol):
    """What the worker needs from an engine.

    ``generate`` is called concurrently for up to ``max_inflight`` requests; the engine batches
    them as it sees fit. ``abort(handle)`` stops one generation (queued inside the engine or
    running): its ``generate`` then returns what was produced so far with finish reason "abort".
    Unknown handles are ignored.

    Optional: an engine that can make an output without waiting (no model time: the synthetic
    engine without per-token time) has ``instant`` true and a synchronous
    ``generate_now(request) -> EngineOutput``; the worker then runs the entries of a claim in one
    pass, without a task and a future per request.
    """

    info: EngineInfo

    async def start(self) -> None: ...

    def validate(self, request: GenerationRequest) -> None:
        """Raise :class:`redroll.shared.codec.ValidationError` for requests this engine cannot serve."""

    async def generate(self, request: GenerationRequest, handle: str) -> EngineOutput: ...

    def abort(self, handle: str) -> None: ...

    async def close(self) -> None: ...


def refuse_extras(request: GenerationRequest, engine: str, *, top_logprobs: bool = False,
                  prompt_logprobs: bool = False, routed_experts: bool = False) -> None:
    """Refuse the per-request extras this engine cannot produce (the flags: what it can)."""
    if request.top_logprobs_num and not top_logprobs:
        raise ValidationError("top_logprobs_num", f"the {engine} engine does not return top logprobs")
    if request.logprob_start_len is not None and not prompt_logprobs:
        raise ValidationError("logprob_start_len", f"the {engine} engine does not return prompt logprobs")
    if request.return_routed_experts and not routed_experts:
        raise ValidationError("return_routed_experts",
                              f"the {engine} engine has no MoE routing to return (SGLang with "
                              "enable_return_routed_experts has)")


def check_token_ids(request: GenerationRequest, vocab_size: int | None, max_context: int | None) -> None:
    """Common engine-side checks: ids inside the vocabulary and the context window."""
    if vocab_size is not None:
        for field_name, ids in (("input_ids", request.input_ids or []),
                                ("sampling_params.stop_token_ids", request.sampling_params.stop_token_ids)):
            if not ids or max(ids) < vocab_size:
                continue  # the common case, checked in C
            for i, t in enumerate(ids):
                if t >= vocab_size:
                    raise ValidationError(f"{field_name}[{i}]", f"token id {t} is outside the vocabulary of {vocab_size}")
    if max_context is not None and request.input_ids is not None:
        total = len(request.input_ids) + request.sampling_params.max_new_tokens
        if total > max_context:
            raise ValidationError(
                "sampling_params.max_new_tokens",
                f"prompt ({len(request.input_ids)}) + max_new_tokens ({request.sampling_params.max_new_tokens}) "
                f"exceeds the model context of {max_context}",
            )
