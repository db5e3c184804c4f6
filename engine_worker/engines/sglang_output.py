"""What SGLang returns for one request, as the worker's :class:`.base.EngineOutput` (a mixin of
:class:`.sglang_engine.SGLangEngine`), and SGLang's per-request errors.

References are to files under ``sglang/srt/`` of sglang 0.5.23, as in :mod:`.sglang_engine`.
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from redroll.engine_worker.engines.base import EngineInfo, EngineOutput, EngineRequestError, SampleOutput
from redroll.engine_worker.engines.text import render_chat, trim_stop
from redroll.shared.types import GenerationRequest

_FINISH_TYPES = ("stop", "length", "abort")



@dataclass(eq=False)
class _Job:
    """One ``generate`` call: n samples, each its own SGLang request."""

    handle: str
    rids: list[str]
    aborted: bool = False
    calls: dict[str, asyncio.Task] = field(default_factory=dict)
    """rid → the task running its ``async_generate`` call (while it runs)."""
    started: set[str] = field(default_factory=set)
    """rids whose call has begun (SGLang may hold state for them)."""
    streamed: dict[str, tuple[list[int], list]] = field(default_factory=dict)
    """rid → (output ids, output_token_logprobs entries) received so far, for streaming samples
    (copies: SGLang hands out its live lists, tokenizer_manager.py:2655-2662)."""
    return_logprob: bool = False
    prompt_ids: list[int] | None = None
    """A chat request's prompt, rendered once with the chat template (sent as ``input_ids``)."""


@dataclass
class _Sample:
    output: SampleOutput
    input_logprobs: list[float | None] | None = None
    prompt_tokens: int | None = None
    cached_tokens: int = 0
    weight_version: str | None = None
    e2e_latency: float | None = None


class SGLangOutput:
    """Mixin: SGLang's output dicts → samples → :class:`.base.EngineOutput` (needs ``self.info``,
    ``self.tokenizer``, ``self._routed_shape`` and ``self._prompt_len``)."""

    info: EngineInfo
    tokenizer: Any
    _routed_shape: tuple[int, int] | None
    _prompt_len: Callable[[GenerationRequest], int | None]

    def _map_output(self, out: Any, job: _Job, request: GenerationRequest, rid: str) -> _Sample:
        if not isinstance(out, dict):
            raise EngineRequestError(f"SGLang returned {type(out).__name__} for rid {rid}, expected one dict "
                                     "(was n passed to SGLang?)", rid=rid)
        meta = out.get("meta_info") or {}
        finish = meta.get("finish_reason")
        reason = _finish_type(finish)
        if reason == "abort" and not job.aborted:
            # Not our abort: an error abort SGLang returned instead of raising (no status code), or an
            # abort from elsewhere (abort_all by a pause or a weight update with abort_all_requests).
            # Nobody asked to abort this request: retry it.
            status = finish.get("status_code") if isinstance(finish, dict) else None
            message = finish.get("message") if isinstance(finish, dict) else None
            raise EngineRequestError(f"aborted inside SGLang, not by redroll: {message or 'Aborted'}",
                                     status_code=int(status) if status is not None else None, rid=rid)
        if reason is None or reason not in _FINISH_TYPES:
            if job.aborted:
                reason = "abort"
            else:
                raise EngineRequestError(f"SGLang returned an unfinished or unknown finish reason {finish!r} "
                                         f"for rid {rid}", rid=rid)
        token_ids = [int(t) for t in (out.get("output_ids") or [])]
        logprobs: list[float] | None = None
        if request.return_logprob:
            # (logprob, token_id, text|None) per output token (tokenizer_manager.py:3104-3116)
            entries = meta.get("output_token_logprobs") or []
            if len(entries) != len(token_ids) or any(
                    e[1] is not None and int(e[1]) != t for e, t in zip(entries, token_ids)):
                raise EngineRequestError(f"SGLang's output_token_logprobs ({len(entries)}) do not line up with "
                                         f"output_ids ({len(token_ids)}) for rid {rid}", rid=rid)
            logprobs = [float(e[0]) for e in entries]
        prompt_tokens = meta.get("prompt_tokens")  # absent for an abort in the waiting queue (:3603-3628)
        latency = meta.get("e2e_latency")
        top = None
        if request.return_logprob and request.top_logprobs_num:
            # per output position, (logprob, token_id, text|None) tuples or None (:3118-3136)
            positions = meta.get("output_top_logprobs") or []
            if len(positions) != len(token_ids):
                raise EngineRequestError(f"SGLang's output_top_logprobs ({len(positions)}) do not line up with "
                                         f"output_ids ({len(token_ids)}) for rid {rid}", rid=rid)
            top = [[(int(e[1]), float(e[0])) for e in (position or ())] for position in positions]
        input_logprobs = None
        if request.return_logprob and request.logprob_start_len is not None:
            # from logprob_start_len on; the first prompt token has no logprob (None)
            input_logprobs = [None if e[0] is None else float(e[0]) for e in meta.get("input_token_logprobs") or []]
        # SGLang's text; its detokenizer cuts a matched stop string unless no_stop_trim
        # (detokenizer_manager.py trim_matched_stop), as trim_stop does: the same cut either way
        text = out.get("text") if request.wants_text and isinstance(out.get("text"), str) else None
        if text is not None:
            text = trim_stop(text, request.sampling_params, reason)
        return _Sample(
            output=SampleOutput(token_ids=token_ids, logprobs=logprobs, finish_reason=reason,
                                weight_versions=_token_versions(meta.get("weight_versions"), len(token_ids), rid),
                                top_logprobs=top, routed_experts=self._routed_experts(meta, rid), text=text),
            input_logprobs=input_logprobs,
            prompt_tokens=int(prompt_tokens) if prompt_tokens is not None else None,
            cached_tokens=int(meta.get("cached_tokens") or 0),
            weight_version=meta.get("weight_version"),
            e2e_latency=float(latency) if latency is not None else None,
        )

    def _routed_experts(self, meta: dict, rid: str) -> Any:
        """``meta_info["routed_experts"]``: base64 of raw int32 (detokenizer_manager.py:432-448), only
        on the finished output (tokenizer_manager.py:2602-2609)."""
        encoded = meta.get("routed_experts")
        if encoded is None or self._routed_shape is None:
            return None
        from redroll.shared.types import RoutedExperts

        data = base64.b64decode(encoded)
        layers, top_k = self._routed_shape
        if len(data) % (4 * layers * top_k):
            raise EngineRequestError(f"SGLang's routed_experts ({len(data)} bytes) do not divide into "
                                     f"{layers} layers x {top_k} experts for rid {rid}", rid=rid)
        return RoutedExperts(shape=(len(data) // (4 * layers * top_k), layers, top_k), data=data)

    @staticmethod
    def _never_started(request: GenerationRequest) -> _Sample:
        return _Sample(SampleOutput(token_ids=[], logprobs=[] if request.return_logprob else None,
                                    finish_reason="abort"))

    def _prompt_ids_to_send(self, request: GenerationRequest) -> list[int] | None:
        """The ids to send SGLang instead of the request's text: a chat rendered here (once for all
        samples), a text prompt encoded here when the record names its prompt ids (so they are what
        ran); None: send the request as it is."""
        if request.messages is not None:
            return render_chat(self.tokenizer, request, "sglang")
        if request.prompt is not None and request.return_prompt_token_ids and self.tokenizer is not None:
            return list(self.tokenizer.encode(request.prompt))
        return None

    def _engine_output(self, request: GenerationRequest, samples: Sequence[_Sample],
                       sent_ids: list[int] | None = None) -> EngineOutput:
        prompt_tokens = max((s.prompt_tokens for s in samples if s.prompt_tokens is not None), default=None)
        if prompt_tokens is None:  # e.g. every sample aborted in SGLang's waiting queue
            prompt_tokens = self._prompt_len(request) or 0
        versions = [s.weight_version for s in samples if s.weight_version is not None]
        latencies = [s.e2e_latency for s in samples if s.e2e_latency is not None]
        extra: dict[str, Any] = {}
        if latencies:
            extra["e2e_latency"] = max(latencies)
        version = str(versions[-1]) if versions else self.info.weight_version
        if any(s.output.weight_versions for s in samples) or any(str(v) != version for v in versions):
            for s in samples:  # one version per token for every sample once they differ
                if s.output.weight_versions is None and s.weight_version is not None:
                    s.output.weight_versions = [str(s.weight_version)] * len(s.output.token_ids)
        return EngineOutput(
            samples=[s.output for s in samples],
            prompt_tokens=prompt_tokens,
            cached_tokens=sum(s.cached_tokens for s in samples),
            weight_version=version,
            extra=extra,
            input_logprobs=next((s.input_logprobs for s in samples if s.input_logprobs is not None), None),
            prompt_token_ids=(list(request.input_ids) if request.input_ids is not None else sent_ids)
            if request.return_prompt_token_ids else None,
        )


def _token_versions(spans: Any, num_tokens: int, rid: str) -> list[str] | None:
    """SGLang's ``meta_info["weight_versions"]`` (utils/weight_versions.py:90-107: contiguous
    half-open ``[start, end)`` spans over the output tokens, equal neighbours merged) as one version
    per token; None when one version made them all (``meta_info.weight_version`` says which)."""
    if not spans or len(spans) < 2:
        return None
    versions: list[str] = []
    for span in spans:
        start, end = int(span["start"]), int(span["end"])
        if start != len(versions) or end < start:
            raise EngineRequestError(f"SGLang's weight_versions spans {spans!r} are not contiguous for rid {rid}",
                                     rid=rid)
        versions.extend([str(span["version"])] * (end - start))
    if len(versions) != num_tokens:
        raise EngineRequestError(f"SGLang's weight_versions cover {len(versions)} tokens, the output has "
                                 f"{num_tokens} for rid {rid}", rid=rid)
    return versions


def _finish_type(finish: Any) -> str | None:
    if isinstance(finish, dict):
        value = finish.get("type")
        return str(value) if value is not None else None
    if isinstance(finish, str):
        return finish
    return None


def _request_error(exc: BaseException, rid: str) -> EngineRequestError:
    """SGLang's exceptions for one request -> :class:`EngineRequestError` (message and status kept)."""
    status = getattr(exc, "status_code", None)  # fastapi.HTTPException (tokenizer_manager.py:1919)
    detail = getattr(exc, "detail", None)
    if status is not None:
        return EngineRequestError(str(detail if detail is not None else exc), status_code=int(status), rid=rid)
    if isinstance(exc, ValueError):  # 400 aborts (:1917-1918) and tokenizer-manager validation
        return EngineRequestError(str(exc), status_code=400, rid=rid)
    return EngineRequestError(f"{type(exc).__name__}: {exc}", rid=rid)
