"""``POST /inference/v1/generate``: vLLM's token-in/token-out endpoint, which prime-rl's and SkyRL's
training paths use (the prompt tokenized by the client, the completion's ids and logprobs back).

One call is one redroll request of ``sampling_params.n`` samples on ``token_ids``; the response is
vLLM's ``GenerateResponse`` in ``output_mode: "tokens"``: per choice its ``token_ids``, its
``finish_reason``, its logprobs (``sampling_params.logprobs``: integer token ids, the sampled token
first, :func:`~redroll.web.gateway.logprobs.generate_logprobs`) and the weight-version spans of its
tokens. Every field is honoured or refused in one line naming it (:class:`GenerateBody`).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

import msgspec
from msgspec import Meta
from starlette.requests import Request

from redroll.producer.request import make_request
from redroll.shared.codec import ValidationError, encode_request
from redroll.shared.types import MAX_TOP_LOGPROBS, CompletionRecord
from redroll.web.gateway.idempotency import call_name, fingerprint
from redroll.web.gateway.logprobs import generate_logprobs, prompt_logprobs
from redroll.web.gateway.protocol import GatewayError, decode_body, invalid
from redroll.web.gateway.translate import META, check_records, redroll_priority, session_key, shared_sampling

SAMPLING_NAMES = {"sampling_params.max_new_tokens": "sampling_params.max_tokens",
                  "sampling_params.min_new_tokens": "sampling_params.min_tokens",
                  "sampling_params.sampling_seed": "sampling_params.seed", "input_ids": "token_ids",
                  "top_logprobs_num": "sampling_params.logprobs", "logprob_start_len": "sampling_params.prompt_logprobs"}
"""redroll's field names (in a refusal) as this endpoint's body names them."""

NOT_TAKEN = {
    "features": "multimodal inputs are not supported",
    "content_parts": "multimodal inputs are not supported",
    "kv_transfer_params": "disaggregated prefill is not supported",
    "ec_transfer_params": "disaggregated encoders are not supported",
    "reasoning_ended": "structured outputs are not applied on this endpoint",
    "reasoning_parser_kwargs": "structured outputs are not applied on this endpoint",
    "token_offsets": "the prompt's text offsets are not read",
    "stream_options": "streaming is not served on this endpoint (stream from /v1/completions)",
}
"""Top-level fields a caller may send that redroll refuses when they are set (not null)."""


class GenerateSampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``SamplingParams`` as a JSON map: the keys redroll honours (any other is refused)."""

    n: Annotated[int, Meta(ge=1, le=128)] = 1
    max_tokens: Optional[Annotated[int, Meta(ge=0)]] = None
    """None: what the model's context leaves after the prompt (as vLLM's server defaults it)."""
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    temperature: Optional[Annotated[float, Meta(ge=0.0, le=2.0)]] = None
    top_p: Optional[Annotated[float, Meta(gt=0.0, le=1.0)]] = None
    top_k: Optional[int] = None
    min_p: Optional[Annotated[float, Meta(ge=0.0, le=1.0)]] = None
    seed: Optional[Annotated[int, Meta(ge=0, le=2**63 - 1)]] = None
    repetition_penalty: Optional[Annotated[float, Meta(gt=0.0, le=2.0)]] = None
    presence_penalty: Optional[Annotated[float, Meta(ge=-2.0, le=2.0)]] = None
    frequency_penalty: Optional[Annotated[float, Meta(ge=-2.0, le=2.0)]] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[Annotated[int, Meta(ge=0)]]] = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    """Honoured as the text's cut; this endpoint returns ids only, which always run to the stop."""
    skip_special_tokens: bool = True
    """Honoured where text is made; this endpoint returns ids only."""
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    """Token ids come back either way (``output_mode: "tokens"``)."""
    logprobs: Optional[Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]] = None
    prompt_logprobs: Optional[int] = None
    output_kind: Annotated[int, Meta(ge=0, le=2)] = 0
    """vLLM's ``RequestOutputKind``: a response that is not streamed is the final output in every kind."""
    cache_salt: Optional[Annotated[str, Meta(min_length=1, max_length=1024)]] = None
    """prime-rl salts with the policy version: redroll never serves a cached prefix across weight versions."""
    routed_experts_prompt_start: Annotated[int, Meta(ge=0)] = 0
    """Where routed-expert data starts: no routed experts are returned here (``routed_experts: null``)."""


class GenerateBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``GenerateRequest``, as far as redroll takes it."""

    token_ids: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(min_length=1)]
    sampling_params: GenerateSampling = msgspec.field(default_factory=GenerateSampling)
    model: Optional[str] = None
    request_id: Optional[Annotated[str, Meta(min_length=1, max_length=256)]] = None
    """Echoed in the response (redroll names its request itself)."""
    return_token_ids: Optional[bool] = None
    """The response carries ``prompt_token_ids`` (the ids sent)."""
    output_mode: Literal["tokens"] = "tokens"
    stream: Optional[bool] = None
    cache_salt: Optional[Annotated[str, Meta(min_length=1, max_length=1024)]] = None
    priority: int = 0
    features: Any = None
    content_parts: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    reasoning_ended: Any = None
    reasoning_parser_kwargs: Any = None
    token_offsets: Any = None
    stream_options: Any = None


def refuse(body: GenerateBody) -> None:
    for name, why in NOT_TAKEN.items():
        if getattr(body, name) is not None:
            raise invalid(name, why)
    if body.stream:
        raise invalid("stream", "streaming is not served on this endpoint (stream from /v1/completions)")
    sp = body.sampling_params
    if sp.top_k is not None and sp.top_k < -1:
        raise invalid("sampling_params.top_k", "must be -1, 0 (both off) or >= 1")
    if sp.prompt_logprobs is not None and sp.prompt_logprobs != 0:
        raise invalid("sampling_params.prompt_logprobs", "only 0 (each prompt token's own logprob): redroll's "
                                                          "engines return no top-k for prompt positions")


def sampling_of(sp: GenerateSampling, max_tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {"n": sp.n, "max_new_tokens": max_tokens, "min_new_tokens": sp.min_tokens,
                           "ignore_eos": sp.ignore_eos, "skip_special_tokens": sp.skip_special_tokens}
    out.update(shared_sampling(sp))
    if sp.include_stop_str_in_output:
        out["no_stop_trim"] = True
    if not sp.spaces_between_special_tokens:
        out["spaces_between_special_tokens"] = False
    return out


def spans(versions: list[Any]) -> list[dict[str, Any]]:
    """Per-token weight versions as vLLM's contiguous spans ``{"version", "start", "end"}``."""
    out: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if out and out[-1]["version"] == str(v):
            out[-1]["end"] = i + 1
        else:
            out.append({"version": str(v), "start": i, "end": i + 1})
    return out


def response(body: GenerateBody, request_id: str, model: str, rec: CompletionRecord) -> dict[str, Any]:
    check_records([rec], SAMPLING_NAMES)
    facts = rec.meta_info.get(META) or {}
    k = body.sampling_params.logprobs
    choices = []
    for j, ids in enumerate(rec.output_token_ids):
        lps = rec.output_logprobs[j] if rec.output_logprobs is not None else None
        tops = rec.output_top_logprobs[j] if rec.output_top_logprobs else None
        choices.append({"index": j, "finish_reason": rec.finish_reasons[j] or "stop", "stop_reason": None,
                        "token_ids": ids, "logprobs": generate_logprobs(ids, lps, tops, k) if k is not None else None,
                        "routed_experts": None, "sampling_mask": None,
                        "weight_versions": spans(rec.token_versions(j))})
    prompt = int(rec.meta_info.get("prompt_tokens") or len(body.token_ids))
    completion = sum(len(ids) for ids in rec.output_token_ids)
    return {"request_id": request_id, "model": model, "created": facts.get("created", int(time.time())),
            "output_mode": "tokens", "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
            "prompt_logprobs": prompt_logprobs(body.token_ids, rec.input_logprobs) if facts.get("plp") else None,
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": list(body.token_ids) if body.return_token_ids else None,
            "weight_version": rec.meta_info.get("weight_version")}


async def generate(gateway: Any, request: Request) -> dict[str, Any]:
    """One ``POST /inference/v1/generate`` call, on ``gateway`` (the
    :class:`redroll.web.gateway.app.Gateway`: not imported, it imports this module)."""
    scope = gateway.authorize(request)
    raw = await request.body()
    body = decode_body(raw, GenerateBody)
    refuse(body)
    pipeline = gateway.pipelines.route(body.model)
    gateway.admit(pipeline)
    sp = body.sampling_params
    max_tokens = sp.max_tokens
    if max_tokens is None:
        context = await pipeline.context_length()
        if context is None:
            raise invalid("sampling_params.max_tokens", "is required while no worker of this model says its context "
                                                        "length")
        max_tokens = max(0, min(context - len(body.token_ids), pipeline.settings.max_new_tokens))
    key = request.headers.get("idempotency-key")
    keyed_name = call_name(key, scope) if key else None
    call_id = keyed_name or f"g-{uuid.uuid4().hex}"
    fp = fingerprint(raw)
    with_prompt_logprobs = sp.prompt_logprobs is not None
    facts: dict[str, Any] = {"created": int(time.time()), "model": body.model or pipeline.name, "fp": fp}
    if with_prompt_logprobs:
        facts["plp"] = True
    try:
        req = make_request(request_id=f"{call_id}-0", input_ids=list(body.token_ids),
                           sampling_params=sampling_of(sp, max_tokens), return_text=False,
                           return_logprob=sp.logprobs is not None or with_prompt_logprobs,
                           top_logprobs_num=sp.logprobs if sp.logprobs and sp.logprobs > 1 else 0,
                           logprob_start_len=0 if with_prompt_logprobs else None, meta_info={META: facts},
                           affinity_key=session_key(request.headers.get("x-session-id")),
                           priority=redroll_priority(body.priority))
        req.reply_to = pipeline.settings.keys_for(req).results  # (checked here; the sender sets its own)
        encode_request(req, pipeline.settings.limits)
    except ValidationError as exc:
        param = SAMPLING_NAMES.get(exc.field, exc.field)
        raise GatewayError(400, f"invalid {param}: {exc.rule}", param=param, code="invalid_value") from None
    gateway._waiting(+1)
    try:
        (rec,) = await gateway.records([req], keyed_name, fp, pipeline)
    finally:
        gateway._waiting(-1)
    out = response(body, body.request_id or call_id, body.model or pipeline.name, rec)
    gateway.metrics.tokens.inc(out["usage"]["completion_tokens"])
    return out


__all__ = ["GenerateBody", "GenerateSampling", "generate", "spans"]
