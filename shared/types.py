"""Typed boundary objects: what a producer asks for and what a worker answers."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, fields
from typing import Any

SCHEMA_VERSION = 1


class RecordStatus(str, enum.Enum):
    FINISHED = "finished"
    ABORTED = "aborted"
    EXPIRED = "expired"
    ERROR = "error"


FINISH_REASONS = ("stop", "length", "abort")

# SGLang sampling keys that are passed through to the engine untouched (after a type check).
PASSTHROUGH_SAMPLING_KEYS: dict[str, tuple[type, ...]] = {
    "json_schema": (str,),
    "regex": (str,),
    "ebnf": (str,),
    "structural_tag": (str,),
    "stop_regex": (str, list),
    "no_stop_trim": (bool,),
    "spaces_between_special_tokens": (bool,),
    "logit_bias": (dict,),
    "custom_params": (dict,),
    "stream_interval": (int,),
}


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters with SGLang's names and defaults."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_new_tokens: int = 0
    sampling_seed: int | None = None
    skip_special_tokens: bool = True
    extra: dict[str, Any] = field(default_factory=dict)
    """Other SGLang keys (see PASSTHROUGH_SAMPLING_KEYS), forwarded as they are."""

    def to_wire(self) -> dict[str, Any]:
        """Only the values that differ from the defaults, as plain msgpack-able types."""
        out: dict[str, Any] = {}
        for name, default in _SAMPLING_DEFAULTS:
            value = getattr(self, name)
            if value != default:
                out[name] = list(value) if isinstance(value, tuple) else value
        out.update(self.extra)
        return out

    def engine_kwargs(self, *, include_n: bool = False) -> dict[str, Any]:
        """Keyword arguments for an SGLang-style ``sampling_params`` dict."""
        out = self.to_wire()
        out["max_new_tokens"] = self.max_new_tokens
        if not include_n:
            out.pop("n", None)
        return out


_SAMPLING_DEFAULTS: tuple[tuple[str, Any], ...] = tuple(
    (f.name, f.default) for f in fields(SamplingParams) if f.name != "extra")
"""(name, default) of every sampling parameter but ``extra``, in declaration order."""


@dataclass
class GenerationRequest:
    """One generation request as it travels on ``{ns}:requests``."""

    request_id: str
    input_ids: list[int] | None = None
    prompt: str | None = None
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = False
    collect_unfinished: bool = False
    meta_info: dict[str, Any] = field(default_factory=dict)
    reply_to: str | None = None
    callback: str | None = None
    group_id: str | None = None
    deadline: float | None = None
    submitted_at: float = field(default_factory=time.time)
    lora_path: str | None = None
    model: str | None = None
    priority: int = 0
    """0 = normal; 1 = high (queued on ``{ns}:requests:high``, claimed before normal requests)."""
    min_weight_version: int | None = None
    """Only workers whose (integer) weight_version is at least this may generate it."""
    requeued: int = 0
    """How often ``redroll dead requeue`` gave this request another attempt (its record says so,
    and consumer groups de-duplicate each attempt on its own: see DESIGN.md "requeue")."""
    v: int = SCHEMA_VERSION

    @property
    def n(self) -> int:
        return self.sampling_params.n


@dataclass
class CompletionRecord:
    """One result record as it travels on a reply stream: one per request_id."""

    request_id: str
    status: RecordStatus
    output_token_ids: list[list[int]] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    output_logprobs: list[list[float]] | None = None
    meta_info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    worker: str | None = None
    callback: str | None = None
    group_id: str | None = None
    requeued: int = 0
    """The request's requeue count: a requeued request's record is a new attempt, not a duplicate."""
    v: int = SCHEMA_VERSION

    @property
    def ok(self) -> bool:
        return self.status is RecordStatus.FINISHED

    @classmethod
    def failed(
        cls,
        request: GenerationRequest | None,
        *,
        request_id: str,
        status: RecordStatus,
        error: str | None,
        worker: str | None,
        n: int = 1,
        meta_info: dict[str, Any] | None = None,
    ) -> "CompletionRecord":
        """A record with no output (ROLL's ``finish_reasons == [None]`` convention)."""
        meta = dict(request.meta_info) if request is not None else {}
        meta.update(meta_info or {})
        return cls(
            request_id=request_id,
            status=status,
            output_token_ids=[[] for _ in range(n)],
            finish_reasons=[None] * n,
            output_logprobs=None,
            meta_info=meta,
            error=error,
            worker=worker,
            callback=request.callback if request is not None else None,
            group_id=request.group_id if request is not None else None,
            requeued=request.requeued if request is not None else 0,
        )

    @property
    def dedup_id(self) -> str:
        """What consumer groups de-duplicate on: the request_id, per requeue attempt."""
        return self.request_id if not self.requeued else f"{self.request_id}#requeue{self.requeued}"
