"""Turn an engine's output into the wire record."""

from __future__ import annotations

from typing import Any

from redroll.engine_worker.engines.base import EngineInfo, EngineOutput
from redroll.shared.types import (
    FIRST_SCHEMA_VERSION,
    TEXT_SCHEMA_VERSION,
    CompletionRecord,
    GenerationRequest,
    RecordStatus,
)


def _as_list(values: Any) -> list:
    """``values`` as the record's list: a list as it is (an engine hands its output over; see
    :class:`SampleOutput`), anything else (a tuple, an array) copied into one. Copying every sample
    again cost about a sixth of the worker's time on records of thousands of tokens."""
    return values if type(values) is list else list(values)


def _ms(value: float) -> float:
    """A non-negative duration in milliseconds, to three decimals (``round(value, 3)`` takes three
    times as long, for no difference a reader of timings can see)."""
    return int(value * 1000.0 + 0.5) / 1000.0


def build_record(
    request: GenerationRequest,
    output: EngineOutput,
    *,
    status: RecordStatus,
    worker: str,
    info: EngineInfo,
    attempt: int,
    queue_ms: float,
    engine_ms: float,
) -> CompletionRecord:
    """The record for a generation that ran (finished, aborted or expired mid-way).

    An aborted or expired request without ``collect_unfinished`` reports no output and
    ``finish_reasons == [None] * n`` (ROLL's convention); with it, the partial tokens and
    logprobs of every sample.
    """
    keep_output = status is RecordStatus.FINISHED or request.collect_unfinished
    samples = output.samples
    versions: list[list[str] | None] | None = None
    top: list[Any] | None = None
    routed: list[Any] | None = None
    texts: list[str] | None = None
    tool_calls: list[Any] | None = None
    if keep_output:
        ids = [_as_list(s.token_ids) for s in samples]
        reasons: list[str | None] = [s.finish_reason for s in samples]
        logprobs = [_as_list(s.logprobs or []) for s in samples] if request.return_logprob else None
        for s in samples:
            if s.weight_versions:
                versions = [list(s.weight_versions) if s.weight_versions else None for s in samples]
                break
        if request.top_logprobs_num and request.return_logprob:
            top = [[list(map(tuple, position)) for position in (s.top_logprobs or [])] for s in samples]
        if request.return_routed_experts:
            routed = [s.routed_experts for s in samples]
        if request.wants_text and all(s.text is not None for s in samples):
            texts = [s.text for s in samples]  # type: ignore[misc]
        if info.tool_calls is not None and request.tools is not None and request.tool_choice != "none":
            calls = [info.tool_calls(request, i, s.token_ids) if s.finish_reason != "abort" else None
                     for i, s in enumerate(samples)]
            tool_calls = calls if any(c is not None for c in calls) else None
    else:
        n = max(len(samples), request.n)
        ids = [[] for _ in range(n)]
        reasons = [None] * n
        logprobs = None
    completion_tokens = 0
    for s in samples:
        completion_tokens += len(s.token_ids)
    meta: dict[str, Any] = {
        **request.meta_info,
        "prompt_tokens": output.prompt_tokens,
        "completion_tokens": completion_tokens,
        "cached_tokens": output.cached_tokens,
        "weight_version": output.weight_version if output.weight_version is not None else info.weight_version,
        "worker": worker,
        "attempt": attempt,
        "queue_ms": _ms(queue_ms),
        "engine_ms": _ms(engine_ms),
        "eos_token_id": info.eos_token_id,
        "pad_token_id": info.pad_token_id,
        "logprob_mode": info.logprob_mode,
    }
    if output.extra:
        meta.update(output.extra)
    return CompletionRecord(
        request_id=request.request_id, status=status, output_token_ids=ids, finish_reasons=reasons,
        output_logprobs=logprobs, meta_info=meta, error=None, worker=worker, callback=request.callback,
        group_id=request.group_id, requeued=request.requeued, weight_versions=versions, output_top_logprobs=top,
        input_logprobs=output.input_logprobs if keep_output and request.logprob_start_len is not None else None,
        routed_experts=routed, output_text=texts, tool_calls=tool_calls,
        prompt_token_ids=output.prompt_token_ids if request.return_prompt_token_ids else None,
        v=TEXT_SCHEMA_VERSION if texts is not None else FIRST_SCHEMA_VERSION)
