"""msgpack codec for request and result entries, with validation.

Every rejection raises :class:`ValidationError` naming the field and the rule it broke. Decoding
never raises anything else, whatever the bytes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

import msgpack

from .types import (
    FINISH_REASONS,
    PASSTHROUGH_SAMPLING_KEYS,
    SCHEMA_VERSION,
    CompletionRecord,
    GenerationRequest,
    RecordStatus,
    SamplingParams,
)

REQUEST_ID_RE = re.compile(r"^[!-z|~]{1,128}\Z")  # \Z, not $: "$" also matches before a final newline
"""1–128 printable ASCII characters, no whitespace, no braces."""

INT64_MAX = 2**63 - 1


class ValidationError(ValueError):
    """A payload broke the wire contract. ``field`` names where, ``rule`` says what."""

    def __init__(self, field: str, rule: str, *, request_id: str | None = None, reply_to: str | None = None):
        super().__init__(f"{field}: {rule}")
        self.field = field
        self.rule = rule
        # Filled in when they could be read, so that a waiter can be told.
        self.request_id = request_id
        self.reply_to = reply_to
        self.callback: str | None = None
        """The handler the request named, when readable (its error record is routed to it)."""

    @property
    def reason(self) -> str:
        return f"invalid {self.field}: {self.rule}"


class NewerSchemaError(ValidationError):
    """The entry was written for a newer schema: hand it back for a newer worker."""


@dataclass(frozen=True)
class Limits:
    """Bounds a request must respect; from :class:`redroll.shared.settings.Settings`."""

    max_payload_bytes: int = 4 * 1024 * 1024
    max_new_tokens: int = 32768
    max_n: int = 64
    max_input_tokens: int = 1_000_000
    max_meta_bytes: int = 64 * 1024


DEFAULT_LIMITS = Limits()


# ---------------------------------------------------------------- low-level helpers


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: Any, field: str) -> Any:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValidationError(field, "missing or not bytes")
    try:
        return msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises many exception types for garbage
        raise ValidationError(field, f"not valid msgpack ({type(exc).__name__})") from None


def _field_str(fields: Mapping[Any, Any], name: str) -> str | None:
    raw = fields.get(name.encode())
    if raw is None:
        raw = fields.get(name)
    if raw is None:
        return None
    if isinstance(raw, (bytes, bytearray)):
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            return None
    return raw if isinstance(raw, str) else None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    t = type(v)
    if t is float:
        return math.isfinite(v)
    if t is int:
        return True
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


def _opt_str(d: dict, key: str, *, max_len: int = 4096) -> str | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise ValidationError(key, f"must be a string or nil, got {type(v).__name__}")
    if len(v) > max_len:
        raise ValidationError(key, f"longer than {max_len} characters")
    return v


def _bool(d: dict, key: str, default: bool = False) -> bool:
    v = d.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ValidationError(key, f"must be a boolean, got {type(v).__name__}")
    return v


def check_request_id(value: Any, field: str = "request_id") -> str:
    if not isinstance(value, str):
        raise ValidationError(field, f"must be a string, got {type(value).__name__}")
    if not REQUEST_ID_RE.match(value):
        raise ValidationError(
            field, "must be 1-128 printable ASCII characters without whitespace or braces"
        )
    return value


def _token_list(value: Any, field: str, max_len: int) -> list[int]:
    if not isinstance(value, list):
        raise ValidationError(field, f"must be a list of integers, got {type(value).__name__}")
    if len(value) > max_len:
        raise ValidationError(field, f"longer than {max_len} tokens")
    if set(map(type, value)) <= {int} and (not value or (min(value) >= 0 and max(value) <= 2**31 - 1)):
        return value  # the common case, checked fast; the loop below says what is wrong otherwise
    for i, t in enumerate(value):
        if not _is_int(t):
            raise ValidationError(f"{field}[{i}]", f"must be an integer, got {type(t).__name__}")
        if t < 0 or t > 2**31 - 1:
            raise ValidationError(f"{field}[{i}]", f"token id {t} out of range")
    return value


# ---------------------------------------------------------------- sampling params

_NUM_RANGES: dict[str, tuple[float, float, bool]] = {
    # name: (low, high, low_inclusive)
    "temperature": (0.0, 100.0, True),
    "top_p": (0.0, 1.0, False),
    "min_p": (0.0, 1.0, True),
    "repetition_penalty": (0.0, 2.0, False),
    "frequency_penalty": (-2.0, 2.0, True),
    "presence_penalty": (-2.0, 2.0, True),
}


_SAMPLING_CACHE: dict[tuple, SamplingParams] = {}
_SAMPLING_CACHE_MAX = 1024


def decode_sampling_params(raw: Any, limits: Limits = DEFAULT_LIMITS) -> SamplingParams:
    """Validate a sampling-parameter map into :class:`SamplingParams`.

    A batch of requests mostly repeats a few maps: each distinct one (keys, value types and
    values, under the same limits) is validated once and its (frozen) result shared.
    """
    if type(raw) is dict:
        try:
            key = (limits, *((k, type(v), v) for k, v in raw.items()))
            cached = _SAMPLING_CACHE.get(key)
        except TypeError:  # an unhashable value (a list): validate it every time
            return _decode_sampling_params(raw, limits)
        if cached is None:
            cached = _decode_sampling_params(raw, limits)
            if not cached.extra and len(_SAMPLING_CACHE) < _SAMPLING_CACHE_MAX:  # (extra is a mutable dict)
                _SAMPLING_CACHE[key] = cached
        return cached
    return _decode_sampling_params(raw, limits)


def _decode_sampling_params(raw: Any, limits: Limits) -> SamplingParams:
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise ValidationError("sampling_params", f"must be a map, got {type(raw).__name__}")
    kw: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in raw.items():
        name = f"sampling_params.{key}"
        if value is None:
            continue
        if key in _NUM_RANGES:
            low, high, low_inc = _NUM_RANGES[key]
            if not _is_num(value):
                raise ValidationError(name, "must be a finite number")
            if value > high or value < low or (value == low and not low_inc):
                bracket = "[" if low_inc else "("
                raise ValidationError(name, f"{value} out of range {bracket}{low}, {high}]")
            kw[key] = float(value)
        elif key == "max_new_tokens":
            if not _is_int(value):
                raise ValidationError(name, "must be an integer")
            if not 0 <= value <= limits.max_new_tokens:
                raise ValidationError(name, f"{value} out of range [0, {limits.max_new_tokens}]")
            kw[key] = value
        elif key == "min_new_tokens":
            if not _is_int(value) or not 0 <= value <= limits.max_new_tokens:
                raise ValidationError(name, f"must be an integer in [0, {limits.max_new_tokens}]")
            kw[key] = value
        elif key == "top_k":
            if not _is_int(value) or not (value == -1 or 1 <= value <= 2**31 - 1):
                raise ValidationError(name, "must be -1 (disabled) or a positive integer")
            kw[key] = value
        elif key == "n":
            if not _is_int(value) or not 1 <= value <= limits.max_n:
                raise ValidationError(name, f"must be an integer in [1, {limits.max_n}]")
            kw[key] = value
        elif key == "sampling_seed":
            if not _is_int(value) or not 0 <= value <= INT64_MAX:
                raise ValidationError(name, "must be a non-negative 64-bit integer")
            kw[key] = value
        elif key == "stop":
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
                raise ValidationError(name, "must be a non-empty string or a list of them")
            if len(value) > 64:
                raise ValidationError(name, "more than 64 stop strings")
            kw[key] = tuple(value)
        elif key == "stop_token_ids":
            kw[key] = tuple(_token_list(value, name, 1024))
        elif key in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(value, bool):
                raise ValidationError(name, "must be a boolean")
            kw[key] = value
        elif key in PASSTHROUGH_SAMPLING_KEYS:
            if not isinstance(value, PASSTHROUGH_SAMPLING_KEYS[key]) or (
                isinstance(value, bool) and bool not in PASSTHROUGH_SAMPLING_KEYS[key]
            ):
                allowed = "/".join(t.__name__ for t in PASSTHROUGH_SAMPLING_KEYS[key])
                raise ValidationError(name, f"must be {allowed}")
            extra[key] = value
        else:
            raise ValidationError(name, "unknown sampling parameter")
    if kw.get("min_new_tokens", 0) > kw.get("max_new_tokens", SamplingParams.max_new_tokens):
        raise ValidationError("sampling_params.min_new_tokens", "larger than max_new_tokens")
    return SamplingParams(extra=extra, **kw)


# ---------------------------------------------------------------- requests


def request_to_map(req: GenerationRequest) -> dict[str, Any]:
    out: dict[str, Any] = {
        "v": req.v,
        "request_id": req.request_id,
        "sampling_params": req.sampling_params.to_wire(),
        "return_logprob": req.return_logprob,
        "collect_unfinished": req.collect_unfinished,
        "meta_info": req.meta_info,
        "reply_to": req.reply_to,
        "callback": req.callback,
        "group_id": req.group_id,
        "deadline": req.deadline,
        "submitted_at": req.submitted_at,
    }
    if req.input_ids is not None:
        out["input_ids"] = req.input_ids
    if req.prompt is not None:
        out["prompt"] = req.prompt
    if req.lora_path is not None:
        out["lora_path"] = req.lora_path
    if req.model is not None:
        out["model"] = req.model
    if req.priority:
        out["priority"] = req.priority
    if req.min_weight_version is not None:
        out["min_weight_version"] = req.min_weight_version
    if req.requeued:
        out["requeued"] = req.requeued
    return out


def encode_request(req: GenerationRequest, limits: Limits = DEFAULT_LIMITS) -> dict[str, bytes]:
    """Validate and encode a request into stream fields: ``rid`` and ``reply_to`` plain, ``data`` msgpack."""
    obj = request_to_map(req)
    data = _pack(obj)
    # The same validation a worker applies: the producer refuses exactly what a worker would.
    validate_request_map(obj, len(data), limits)
    fields = {"rid": req.request_id.encode()}
    if req.reply_to:
        fields["reply_to"] = req.reply_to.encode()
    fields["data"] = data
    return fields


def decode_request(fields: Mapping[Any, Any], limits: Limits = DEFAULT_LIMITS) -> GenerationRequest:
    """Decode and validate request stream fields. Raises only :class:`ValidationError`."""
    data = fields.get(b"data")
    if data is None:
        data = fields.get("data")
    try:
        obj = _unpack(data, "data")
    except ValidationError as exc:
        exc.request_id = _readable_request_id(fields)
        exc.reply_to = _field_str(fields, "reply_to") or None
        raise
    try:
        return validate_request_map(obj, len(data), limits)
    except ValidationError as exc:
        # Say who is waiting, from the payload if it can be read there, else from the plain fields.
        rid = obj.get("request_id") if isinstance(obj, dict) else None
        reply_to = obj.get("reply_to") if isinstance(obj, dict) else None
        if exc.request_id is None:
            ok = isinstance(rid, str) and REQUEST_ID_RE.match(rid)
            exc.request_id = rid if ok else _readable_request_id(fields)
        if exc.reply_to is None:
            exc.reply_to = reply_to if isinstance(reply_to, str) else (_field_str(fields, "reply_to") or None)
        callback = obj.get("callback") if isinstance(obj, dict) else None
        if isinstance(callback, str) and len(callback) <= 256:
            exc.callback = callback
        raise


def _readable_request_id(fields: Mapping[Any, Any]) -> str | None:
    rid = _field_str(fields, "rid")
    return rid if rid is not None and REQUEST_ID_RE.match(rid) else None


def validate_request_map(obj: Any, size: int, limits: Limits = DEFAULT_LIMITS) -> GenerationRequest:
    if size > limits.max_payload_bytes:
        raise ValidationError("data", f"payload of {size} bytes exceeds the limit of {limits.max_payload_bytes}")
    if not isinstance(obj, dict):
        raise ValidationError("data", f"must be a map, got {type(obj).__name__}")
    get = obj.get  # (every request runs this: plain local lookups, type() checks for the common case)
    v = get("v")
    if type(v) is not int or v < 1:
        raise ValidationError("v", "schema version must be a positive integer")
    request_id = check_request_id(get("request_id"))
    if v > SCHEMA_VERSION:
        raise NewerSchemaError("v", f"schema version {v} is newer than {SCHEMA_VERSION}", request_id=request_id)
    input_ids = get("input_ids")
    prompt = get("prompt")
    if (input_ids is None) == (prompt is None):
        raise ValidationError("input_ids/prompt", "exactly one of input_ids or prompt is required")
    if input_ids is not None:
        input_ids = _token_list(input_ids, "input_ids", limits.max_input_tokens)
        if not input_ids:
            raise ValidationError("input_ids", "must not be empty")
    else:
        if not isinstance(prompt, str):
            raise ValidationError("prompt", f"must be a string, got {type(prompt).__name__}")
        if not prompt:
            raise ValidationError("prompt", "must not be empty")
    sampling = decode_sampling_params(get("sampling_params"), limits)
    meta = get("meta_info")
    if meta is None:
        meta = {}
    elif not isinstance(meta, dict) or (meta and not all(isinstance(k, str) for k in meta)):
        raise ValidationError("meta_info", "must be a map with string keys")
    elif meta and len(_pack(meta)) > limits.max_meta_bytes:
        raise ValidationError("meta_info", f"larger than {limits.max_meta_bytes} bytes")
    reply_to = get("reply_to")
    if reply_to is not None and (type(reply_to) is not str or len(reply_to) > 512):
        reply_to = _opt_str(obj, "reply_to", max_len=512)  # (raises, or accepts a str subclass)
    callback = get("callback")
    if callback is not None and (type(callback) is not str or len(callback) > 256):
        callback = _opt_str(obj, "callback", max_len=256)
    group_id = get("group_id")
    if group_id is not None:
        group_id = check_request_id(group_id, "group_id")
    deadline = get("deadline")
    if deadline is not None and not _is_num(deadline):
        raise ValidationError("deadline", "must be unix seconds (a number) or nil")
    priority = get("priority", 0)
    if priority is None:
        priority = 0
    if type(priority) is not int or priority not in (0, 1):
        raise ValidationError("priority", "must be 0 (normal) or 1 (high)")
    min_wv = get("min_weight_version")
    if min_wv is not None and (not _is_int(min_wv) or min_wv < 0):
        raise ValidationError("min_weight_version", "must be a non-negative integer or nil")
    requeued = get("requeued", 0)
    if requeued is None:
        requeued = 0
    if type(requeued) is not int or requeued < 0:
        raise ValidationError("requeued", "must be a non-negative integer")
    submitted_at = get("submitted_at")
    if not _is_num(submitted_at):
        raise ValidationError("submitted_at", "must be unix seconds (a number)")
    return_logprob = get("return_logprob")
    if type(return_logprob) is not bool:
        return_logprob = _bool(obj, "return_logprob")
    collect_unfinished = get("collect_unfinished")
    if type(collect_unfinished) is not bool:
        collect_unfinished = _bool(obj, "collect_unfinished")
    lora_path = get("lora_path")
    model = get("model")
    return GenerationRequest(
        request_id=request_id,
        input_ids=input_ids,
        prompt=prompt,
        sampling_params=sampling,
        return_logprob=return_logprob,
        collect_unfinished=collect_unfinished,
        meta_info=meta,
        reply_to=reply_to,
        callback=callback,
        group_id=group_id,
        deadline=float(deadline) if deadline is not None else None,
        submitted_at=float(submitted_at),
        lora_path=None if lora_path is None else _opt_str(obj, "lora_path"),
        model=None if model is None else _opt_str(obj, "model"),
        priority=priority,
        min_weight_version=min_wv,
        requeued=requeued,
        v=v,
    )


# ---------------------------------------------------------------- records


def record_to_map(rec: CompletionRecord) -> dict[str, Any]:
    return {
        "v": rec.v,
        "request_id": rec.request_id,
        "output_token_ids": rec.output_token_ids,
        "finish_reasons": rec.finish_reasons,
        "output_logprobs": rec.output_logprobs,
        "meta_info": rec.meta_info,
        "error": rec.error,
        "callback": rec.callback,
        "group_id": rec.group_id,
        **({"requeued": rec.requeued} if rec.requeued else {}),
    }


def encode_record(rec: CompletionRecord) -> dict[str, bytes]:
    """Encode a record into stream fields: ``rid``, ``status``, ``worker`` plain, ``data`` msgpack."""
    return {
        "rid": rec.request_id.encode(),
        "status": rec.status.value.encode(),
        "worker": (rec.worker or "").encode(),
        "data": _pack(record_to_map(rec)),
    }


_STATUS_BY_FIELD: dict[Any, RecordStatus] = {
    **{s.value.encode(): s for s in RecordStatus}, **{s.value: s for s in RecordStatus}}
_NUMBER_TYPES = {int, float}
_REASONS_OK = {None, *FINISH_REASONS}


def decode_record(fields: Mapping[Any, Any]) -> CompletionRecord:
    """Decode and validate a result entry. Raises only :class:`ValidationError`."""
    status = _STATUS_BY_FIELD.get(fields.get(b"status"))
    if status is None:
        status_raw = _field_str(fields, "status")
        try:
            status = RecordStatus(status_raw)
        except ValueError:
            raise ValidationError("status", f"unknown status {status_raw!r}") from None
    data = fields.get(b"data")
    obj = _unpack(data if data is not None else fields.get("data"), "data")
    if not isinstance(obj, dict):
        raise ValidationError("data", f"must be a map, got {type(obj).__name__}")
    v = obj.get("v")
    if not _is_int(v) or v < 1:
        raise ValidationError("v", "schema version must be a positive integer")
    request_id = check_request_id(obj.get("request_id"))
    ids = obj.get("output_token_ids")
    if not isinstance(ids, list):
        raise ValidationError("output_token_ids", "must be a list per sample")
    ids = [_token_list(s, f"output_token_ids[{i}]", 10**7) for i, s in enumerate(ids)]
    reasons = obj.get("finish_reasons")
    if not isinstance(reasons, list) or len(reasons) != len(ids):
        raise ValidationError("finish_reasons", "must be a list with one entry per sample")
    for i, r in enumerate(reasons):
        if r is not None and (type(r) is not str or r not in _REASONS_OK):
            raise ValidationError(f"finish_reasons[{i}]", f"unknown finish reason {r!r}")
    logprobs = obj.get("output_logprobs")
    if logprobs is not None:
        if not isinstance(logprobs, list) or len(logprobs) != len(ids):
            raise ValidationError("output_logprobs", "must be a list with one entry per sample")
        for i, (lp, s) in enumerate(zip(logprobs, ids)):
            if not isinstance(lp, list) or len(lp) != len(s):
                raise ValidationError(f"output_logprobs[{i}]", "must have the same length as its token ids")
            if not set(map(type, lp)) <= _NUMBER_TYPES:  # one pass in C; bool is not a number here
                raise ValidationError(f"output_logprobs[{i}]", "must be numbers")
    meta = obj.get("meta_info") or {}
    if not isinstance(meta, dict):
        raise ValidationError("meta_info", "must be a map")
    error = obj.get("error")
    if error is not None and not isinstance(error, str):
        raise ValidationError("error", "must be a string or nil")
    requeued = obj.get("requeued") or 0
    if not _is_int(requeued) or requeued < 0:
        raise ValidationError("requeued", "must be a non-negative integer")
    return CompletionRecord(
        request_id=request_id,
        status=status,
        output_token_ids=ids,
        finish_reasons=reasons,
        output_logprobs=logprobs,
        meta_info=meta,
        error=error,
        worker=_field_str(fields, "worker") or None,
        callback=_opt_str(obj, "callback", max_len=256),
        group_id=_opt_str(obj, "group_id", max_len=256),
        requeued=requeued,
        v=v,
    )


__all__ = [
    "DEFAULT_LIMITS",
    "Limits",
    "NewerSchemaError",
    "SCHEMA_VERSION",
    "ValidationError",
    "check_request_id",
    "decode_record",
    "decode_request",
    "decode_sampling_params",
    "encode_record",
    "encode_request",
]
