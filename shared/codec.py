"""The MessagePack codec of request and result entries: msgspec decodes and validates in one pass
against the Structs of :mod:`.types`; this module adds what a static schema cannot say.

* the stream-field envelope (plain ``rid``, ``reply_to``, ``status``, ``worker`` beside ``data``);
* limits that come from settings (payload bytes, ``max_new_tokens``, ``n``, input length, the size
  of ``meta_info``) and cross-field rules (exactly one of ``input_ids`` / ``prompt`` / ``messages``,
  ``min_new_tokens`` ≤ ``max_new_tokens``, one finish reason and one logprob list per sample);
* the schema version: the lowest one that carries a request's fields, stamped when it is encoded
  and required when it is decoded, and the newer-``v`` hand-back (``Limits.schema_version``,
  the newest a reader knows); nil standing for a default (a producer may send ``null`` for an
  optional key);
* recovering ``request_id``, ``reply_to`` and ``callback`` from an invalid entry, so that its
  waiter can be told.

Every rejection raises :class:`ValidationError` naming the field (the path msgspec reports,
e.g. ``input_ids[3]``) and the rule. Decoding never raises anything else, whatever the bytes.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, Mapping

import msgspec

from redroll.shared.record_codec import decode_record, encode_record, record_to_map
from redroll.shared.types import (
    AGENT_SCHEMA_VERSION,
    PROMPT_SCHEMA_VERSION,
    REQUEST_ID_PATTERN,
    REQUEST_ID_RULE,
    RESERVED_CHAT_TEMPLATE_KWARGS,
    SCHEMA_VERSION,
    SCHEMA_VERSION_RULE,
    STREAM_SCHEMA_VERSION,
    TEXT_SCHEMA_VERSION,
    ChatMessage,
    GenerationRequest,
    SamplingParams,
    request_schema_version,
)
from redroll.shared.validation import TOO_DEEP, NewerSchemaError, ValidationError, _data, _field_str, _from_msgspec

REQUEST_ID_RE = re.compile(REQUEST_ID_PATTERN)


@dataclass(frozen=True)
class Limits:
    """Bounds a request must respect; from :class:`redroll.shared.settings.Settings`."""

    max_payload_bytes: int = 4 * 1024 * 1024
    max_new_tokens: int = 32768
    max_n: int = 64
    max_input_tokens: int = 1_000_000
    max_meta_bytes: int = 64 * 1024
    schema_version: int = SCHEMA_VERSION
    """The newest request schema this reader knows: a request with a newer ``v`` is handed back
    (:class:`NewerSchemaError`) for a worker that knows it."""


DEFAULT_LIMITS = Limits()

_ENCODER = msgspec.msgpack.Encoder()
_REQUEST_DECODER = msgspec.msgpack.Decoder(GenerationRequest)
_ANY_DECODER = msgspec.msgpack.Decoder()



def _encode_value(obj: Any, field: str) -> bytes:
    """``obj`` encoded; a value MessagePack cannot hold is a :class:`ValidationError` naming ``field``."""
    try:
        return _ENCODER.encode(obj)
    except OverflowError:  # (an int from JSON or Python beyond 64 bits)
        raise ValidationError(field, "holds an integer outside MessagePack's 64-bit range") from None
    except RecursionError:
        raise ValidationError(field, TOO_DEEP) from None

def check_request_id(value: Any, field: str = "request_id") -> str:
    if not isinstance(value, str):
        raise ValidationError(field, f"must be a string, got {type(value).__name__}")
    if not REQUEST_ID_RE.match(value):
        raise ValidationError(field, REQUEST_ID_RULE)
    return value


# ---------------------------------------------------------------- what the schema cannot say


def check_sampling_params(sp: SamplingParams, limits: Limits, prefix: str = "sampling_params.") -> SamplingParams:
    """The bounds that come from settings, and the cross-field rules, of decoded sampling params."""
    if sp.n > limits.max_n:
        raise ValidationError(prefix + "n", f"must be an integer in [1, {limits.max_n}]")
    if sp.max_new_tokens > limits.max_new_tokens:
        raise ValidationError(prefix + "max_new_tokens",
                              f"{sp.max_new_tokens} out of range [0, {limits.max_new_tokens}]")
    if sp.min_new_tokens > limits.max_new_tokens:
        raise ValidationError(prefix + "min_new_tokens", f"must be an integer in [0, {limits.max_new_tokens}]")
    if sp.min_new_tokens > sp.max_new_tokens:
        raise ValidationError(prefix + "min_new_tokens", "larger than max_new_tokens")
    if sp.top_k == 0:
        raise ValidationError(prefix + "top_k", "must be -1 (disabled) or a positive integer")
    return sp


def _check_request(req: GenerationRequest, limits: Limits) -> GenerationRequest:
    try:
        if req.v == 0:
            raise ValidationError("v", SCHEMA_VERSION_RULE)
        if req.submitted_at is None:
            raise ValidationError("submitted_at", "must be unix seconds (a number)")
        if (req.input_ids is not None) + (req.prompt is not None) + (req.messages is not None) != 1:
            raise ValidationError("input_ids/prompt/messages", "exactly one of input_ids, prompt or messages is required")
        if req.messages is not None:
            _check_messages(req)
        elif req.tools is not None:
            raise ValidationError("tools", "needs messages (tools are handed to the chat template)")
        _check_chat_template(req)
        _check_agent_fields(req)
        needed = request_schema_version(req)
        if req.v < needed:
            raise ValidationError("v", f"must be at least {needed} for a request with {_NEEDS[needed]}, got {req.v}")
        if req.input_ids is not None and len(req.input_ids) > limits.max_input_tokens:
            raise ValidationError("input_ids", f"longer than {limits.max_input_tokens} tokens")
        check_sampling_params(req.sampling_params, limits)
        if (req.top_logprobs_num or req.logprob_start_len is not None) and not req.return_logprob:
            field = "top_logprobs_num" if req.top_logprobs_num else "logprob_start_len"
            raise ValidationError(field, "needs return_logprob")
        if (req.logprob_start_len is not None and req.input_ids is not None
                and req.logprob_start_len >= len(req.input_ids)):
            raise ValidationError("logprob_start_len", f"must be below the prompt length ({len(req.input_ids)})")
        if req.resumable and (req.sampling_params.n != 1 or req.input_ids is None):
            raise ValidationError("resumable", "needs a single-sample request (n = 1) with input_ids (a resumed "
                                               "request continues from prompt + saved token ids)")
        if req.stream and req.sampling_params.n != 1:
            raise ValidationError("sampling_params.n", f"a streamed request makes one sample, got n={req.sampling_params.n} "
                                                       "(send one streamed request per sample, as the gateway does)")
        if req.stream and req.reply_to is None:
            raise ValidationError("reply_to", "a streamed request needs a reply stream: its chunks go beside it "
                                              "(Producer.stream sets it)")
        if req.resumable and req.return_text:
            raise ValidationError("return_text", "not with resumable (a resumed request's text would cover only "
                                                 "what it made after its checkpoint)")
        if req.meta_info and len(_encode_value(req.meta_info, "meta_info")) > limits.max_meta_bytes:
            raise ValidationError("meta_info", f"larger than {limits.max_meta_bytes} bytes")
    except ValidationError as exc:
        exc.request_id, exc.reply_to, exc.callback = req.request_id, req.reply_to, req.callback
        raise
    return req


_NEEDS = {STREAM_SCHEMA_VERSION: "stream", TEXT_SCHEMA_VERSION: "messages, tools or return_text",
          PROMPT_SCHEMA_VERSION: "return_prompt_token_ids, chat_template or chat_template_kwargs",
          AGENT_SCHEMA_VERSION: "tool_choice or prefix_ids"}
"""What makes a request need each schema version, as a refusal says it."""


def _check_chat_template(req: GenerationRequest) -> None:
    """``chat_template`` and ``chat_template_kwargs`` go with ``messages``; the kwargs are template
    variables only (``apply_chat_template``'s own parameters are the worker's)."""
    for name in ("chat_template", "chat_template_kwargs"):
        if getattr(req, name) is not None and req.messages is None:
            raise ValidationError(name, "needs messages (it is handed to the chat template)")
    for key in req.chat_template_kwargs or {}:
        if not isinstance(key, str) or not key.isidentifier():
            raise ValidationError("chat_template_kwargs", f"a key must be a template variable name, got {key!r}")
        if key in RESERVED_CHAT_TEMPLATE_KWARGS:
            raise ValidationError(f"chat_template_kwargs.{key}",
                                  "is apply_chat_template's own parameter, set by the worker (not a template variable)")


def named_tool(tool_choice: Any) -> str | None:
    """The function a named ``tool_choice`` names (None for a word or nil)."""
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
    return None


def tool_names(tools: Any) -> list[str]:
    """The function names of a request's ``tools`` (OpenAI's ``{"type": "function", "function": {...}}``)."""
    names = []
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.append(function["name"])
    return names


def _check_agent_fields(req: GenerationRequest) -> None:
    """``tool_choice`` goes with ``tools`` (a named one names one of them); ``prefix_ids`` with a
    text or chat prompt (it is the part before it)."""
    if req.parallel_tool_calls is not None and req.tools is None:
        raise ValidationError("parallel_tool_calls", "needs tools")
    choice = req.tool_choice
    if choice is not None:
        if req.tools is None:
            raise ValidationError("tool_choice", "needs tools")
        if isinstance(choice, dict):
            name = named_tool(choice)
            if choice.get("type") != "function" or name is None or set(choice) - {"type", "function"} \
                    or set(choice["function"]) != {"name"}:
                raise ValidationError("tool_choice", "a named choice is {\"type\": \"function\", \"function\": "
                                                     "{\"name\": NAME}}")
            if name not in tool_names(req.tools):
                raise ValidationError("tool_choice.function.name", f"{name!r} is not one of the tools")
    if req.prefix_ids is not None and req.input_ids is not None:
        raise ValidationError("prefix_ids", "goes with messages or prompt (with input_ids, send the whole prompt)")


def _check_messages(req: GenerationRequest) -> None:
    for i, message in enumerate(req.messages or ()):
        if message.content is None and not message.tool_calls:
            raise ValidationError(f"messages[{i}].content", "is required (only a turn with tool_calls may leave it out)")


def _newer(v: int, limits: Limits, request_id: Any) -> NewerSchemaError:
    rid = request_id if isinstance(request_id, str) and REQUEST_ID_RE.match(request_id) else None
    return NewerSchemaError("v", f"schema version {v} is newer than {limits.schema_version}", request_id=rid)


def _without_nils(obj: Any) -> tuple[Any, bool]:
    """``obj`` with nil values dropped at the top and in ``sampling_params`` (nil means "the default"
    for an optional key), and whether anything was dropped."""
    if not isinstance(obj, dict):
        return obj, False
    sampling = obj.get("sampling_params")
    if None not in obj.values() and not (isinstance(sampling, dict) and None in sampling.values()):
        return obj, False  # (the usual line: nothing to drop, no copy)
    out = {k: v for k, v in obj.items() if v is not None}
    dropped = len(out) != len(obj)
    sampling = out.get("sampling_params")
    if isinstance(sampling, dict):
        kept = {k: v for k, v in sampling.items() if v is not None}
        if len(kept) != len(sampling):
            out["sampling_params"], dropped = kept, True
    return out, dropped


# ---------------------------------------------------------------- requests


def request_to_map(req: GenerationRequest) -> dict[str, Any]:
    return msgspec.to_builtins(req)


def encode_request(req: GenerationRequest, limits: Limits = DEFAULT_LIMITS, *, check: bool = True) -> dict[str, bytes]:
    """Validate and encode a request into stream fields: ``rid`` and ``reply_to`` plain, ``data``
    msgpack. The producer refuses exactly what a worker would: the bytes are decoded as a worker
    decodes them (``check=False`` skips that for a request validated so before). ``v`` 0 becomes
    the lowest schema version that carries every field the request uses, a missing
    ``submitted_at`` now."""
    if req.v == 0:
        req.v = request_schema_version(req)
    if req.submitted_at is None:
        req.submitted_at = time.time()
    data = _encode_value(req, "data")
    if check:
        decode_request_data(data, limits)
    fields = {"rid": req.request_id.encode()}
    if req.reply_to:
        fields["reply_to"] = req.reply_to.encode()
    fields["data"] = data
    return fields


def decode_request(fields: Mapping[Any, Any], limits: Limits = DEFAULT_LIMITS) -> GenerationRequest:
    """Decode and validate request stream fields. Raises only :class:`ValidationError`."""
    try:
        return decode_request_data(_data(fields), limits)
    except ValidationError as exc:
        # Say who is waiting: from the payload if it could be read there, else the plain fields.
        if exc.request_id is None:
            rid = _field_str(fields, "rid")
            exc.request_id = rid if rid is not None and REQUEST_ID_RE.match(rid) else None
        if exc.reply_to is None:
            exc.reply_to = _field_str(fields, "reply_to") or None
        raise


def decode_request_data(data: bytes, limits: Limits = DEFAULT_LIMITS) -> GenerationRequest:
    """Decode and validate a request's ``data`` map."""
    if len(data) > limits.max_payload_bytes:
        raise ValidationError("data", f"payload of {len(data)} bytes exceeds the limit of {limits.max_payload_bytes}")
    try:
        req = _decode_request_struct(data, limits)
    except RecursionError:  # (see TOO_DEEP)
        raise ValidationError("data", TOO_DEEP) from None
    if req.v > limits.schema_version:
        raise _newer(req.v, limits, req.request_id)
    return _check_request(req, limits)


def _decode_request_struct(data: bytes, limits: Limits) -> GenerationRequest:
    try:
        return _REQUEST_DECODER.decode(data)
    except msgspec.ValidationError as exc:  # (a subclass of DecodeError: first)
        return _decode_leniently(data, exc, limits)
    except msgspec.DecodeError as exc:
        raise ValidationError("data", f"not valid msgpack ({exc})") from None


def request_from_values(values: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> GenerationRequest:
    """A request from plain values (a JSON line of ``redroll submit``), refused exactly as a worker
    would refuse its encoding: nil values mean the default, as on the wire; the same schema,
    bounds and cross-field rules; the payload limit on the bytes the producer will write. One
    conversion in C, where :func:`encode_request` on a hand-built request encodes and decodes it."""
    stripped, _dropped = _without_nils(values)
    v = stripped.get("v")
    if type(v) is int and v > limits.schema_version:  # (first, whatever else is wrong: as a worker decodes)
        raise _newer(v, limits, stripped.get("request_id"))
    try:
        req = msgspec.convert(stripped, GenerationRequest)
    except msgspec.ValidationError as exc:
        raise _from_msgspec(exc) from None
    return check_unsent(req, limits, stamp_v="v" not in stripped, stamp_at="submitted_at" not in stripped)


def check_unsent(req: GenerationRequest, limits: Limits = DEFAULT_LIMITS, *, stamp_v: bool = True,
                 stamp_at: bool = True) -> GenerationRequest:
    """Check a request that msgspec built from plain values (or a JSON line) as it will be sent:
    the cross-field rules, the limits and the payload limit on the bytes the producer will write.
    A ``v`` or ``submitted_at`` the values left out (``stamp_v``, ``stamp_at``) is stamped at the
    submit, as encode_request does, so it is only stood in for here. Returns ``req`` unchanged."""
    v, at = req.v, req.submitted_at
    if stamp_v:
        req.v = request_schema_version(req)
    if stamp_at:
        req.submitted_at = time.time()
    try:
        _check_request(req, limits)
        size = len(_encode_value(req, "data"))
    finally:
        req.v, req.submitted_at = v, at
    if size > limits.max_payload_bytes:
        raise ValidationError("data", f"payload of {size} bytes exceeds the limit of {limits.max_payload_bytes}")
    return req


def _decode_leniently(data: bytes, first: msgspec.ValidationError, limits: Limits) -> GenerationRequest:
    """After a strict decode failed: a newer ``v`` is handed back whatever else is wrong; nil
    values are dropped and the decode tried once more; otherwise the first error, with whatever
    can be read of the request's id, reply stream and handler."""
    try:
        obj = _ANY_DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise ValidationError("data", f"not valid msgpack ({exc})") from None
    if not isinstance(obj, dict):
        raise ValidationError("data", f"must be a map, got {type(obj).__name__}") from None
    v, rid = obj.get("v"), obj.get("request_id")
    readable_rid = rid if isinstance(rid, str) and REQUEST_ID_RE.match(rid) else None
    if type(v) is int and v > limits.schema_version:
        raise _newer(v, limits, rid)
    stripped, dropped = _without_nils(obj)
    error = _from_msgspec(first)
    if dropped:
        try:
            return _REQUEST_DECODER.decode(_ENCODER.encode(stripped))
        except msgspec.ValidationError as exc:
            error = _from_msgspec(exc)
    error.request_id = readable_rid
    reply_to, callback = obj.get("reply_to"), obj.get("callback")
    error.reply_to = reply_to if isinstance(reply_to, str) else None
    error.callback = callback if isinstance(callback, str) and len(callback) <= 256 else None
    raise error from None


def decode_sampling_params(raw: Any, limits: Limits = DEFAULT_LIMITS) -> SamplingParams:
    """Validate a sampling-parameter map (the producer's helper: what a worker would accept)."""
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise ValidationError("sampling_params", f"must be a map, got {type(raw).__name__}")
    try:
        sp = msgspec.convert({k: v for k, v in raw.items() if v is not None}, SamplingParams)
    except msgspec.ValidationError as exc:
        raise _from_msgspec(exc, "sampling_params.") from None
    return check_sampling_params(sp, limits)


def decode_messages(raw: Any) -> list[ChatMessage]:
    """Chat messages from plain maps (or :class:`ChatMessage`), refused naming the field (the
    producer's helper: what a worker would accept)."""
    if isinstance(raw, (str, bytes, Mapping)) or not hasattr(raw, "__iter__"):
        raise ValidationError("messages", f"must be a list of messages, got {type(raw).__name__}")
    try:
        messages = msgspec.convert([msgspec.to_builtins(m) for m in raw], list[ChatMessage])
    except msgspec.ValidationError as exc:
        raise _from_msgspec(exc, "messages") from None
    return messages


__all__ = [
    "DEFAULT_LIMITS",
    "Limits",
    "NewerSchemaError",
    "SCHEMA_VERSION",
    "TOO_DEEP",
    "ValidationError",
    "check_request_id",
    "check_sampling_params",
    "decode_messages",
    "decode_record",
    "decode_request",
    "decode_request_data",
    "decode_sampling_params",
    "encode_record",
    "encode_request",
    "record_to_map",
]
