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

import functools
import re
import time
from dataclasses import dataclass
from typing import Any, Mapping

import msgspec

from redroll.errors import RedrollError

from .types import (
    RECORD_DATA_FIELDS,
    REQUEST_ID_PATTERN,
    REQUEST_ID_RULE,
    SCHEMA_VERSION,
    SCHEMA_VERSION_RULE,
    ChatMessage,
    CompletionRecord,
    GenerationRequest,
    RecordData,
    RecordStatus,
    SamplingParams,
    request_schema_version,
)

REQUEST_ID_RE = re.compile(REQUEST_ID_PATTERN)


class ValidationError(RedrollError, ValueError):
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
    schema_version: int = SCHEMA_VERSION
    """The newest request schema this reader knows: a request with a newer ``v`` is handed back
    (:class:`NewerSchemaError`) for a worker that knows it."""


DEFAULT_LIMITS = Limits()

_ENCODER = msgspec.msgpack.Encoder()
_REQUEST_DECODER = msgspec.msgpack.Decoder(GenerationRequest)
_RECORD_DECODER = msgspec.msgpack.Decoder(RecordData)
_ANY_DECODER = msgspec.msgpack.Decoder()

TOO_DEEP = "maps or lists nested too deeply"
"""The rule a payload breaks when msgspec's decoders, which recurse in C, hit Python's recursion
limit (about 1,000 levels): a poison payload, refused like any other invalid one."""


def _encode_value(obj: Any, field: str) -> bytes:
    """``obj`` encoded; a value MessagePack cannot hold is a :class:`ValidationError` naming ``field``."""
    try:
        return _ENCODER.encode(obj)
    except OverflowError:  # (an int from JSON or Python beyond 64 bits)
        raise ValidationError(field, "holds an integer outside MessagePack's 64-bit range") from None
    except RecursionError:
        raise ValidationError(field, TOO_DEEP) from None

# ---------------------------------------------------------------- msgspec errors → ValidationError

_AT = re.compile(r" - at `\$\.?(.*)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(.*)`$")
_MISSING = re.compile(r"^Object missing required field `(.*)`$")
_GOT = re.compile(r", got `(\w+)`$")
_COLLAPSE = ("sampling_params.stop[", "sampling_params.stop_regex", "sampling_params.logit_bias",
             "sampling_params.custom_params", "meta_info")
"""Paths reported at their field, not deeper (a stop string, a key inside meta_info)."""


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _from_msgspec(exc: msgspec.ValidationError, prefix: str = "") -> ValidationError:
    message = str(exc)
    at = _AT.search(message)
    path = at.group(1) if at else ""
    rule = message[: at.start()] if at else message
    if m := _UNKNOWN.match(rule):
        path = _join(path, m.group(1))
        rule = ("unknown sampling parameter" if path.startswith("sampling_params") or prefix.startswith("sampling_params")
                else "unknown field")
    elif m := _MISSING.match(rule):
        path = _join(path, m.group(1))
        rule = "is required"
    path = prefix + path if path else prefix.rstrip(".")
    # The rule in words, not msgspec's regex or bound (the one pattern is the request_id's).
    if rule.startswith("Expected `str` matching regex") or (path == "request_id" and rule.startswith("Expected")):
        got = _GOT.search(rule)
        rule = REQUEST_ID_RULE + (f", got {got.group(1)}" if got else "")
    elif path == "v" and rule.startswith("Expected"):
        got = _GOT.search(rule)
        rule = SCHEMA_VERSION_RULE + (f", got {got.group(1)}" if got else "")
    for short in _COLLAPSE:
        if path.startswith(short):
            path = short.rstrip("[")
    if re.match(r"^(output_logprobs|weight_versions)\[\d+\]\[", path):
        path = path[: path.index("]") + 1]
    return ValidationError(path or "data", rule)


# ---------------------------------------------------------------- the stream-field envelope


def _field(fields: Mapping[Any, Any], name: str) -> Any:
    raw = fields.get(name.encode())
    return fields.get(name) if raw is None else raw


def _field_str(fields: Mapping[Any, Any], name: str) -> str | None:
    raw = _field(fields, name)
    if isinstance(raw, (bytes, bytearray)):
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return None
    return raw if isinstance(raw, str) else None


def _data(fields: Mapping[Any, Any]) -> bytes:
    data = _field(fields, "data")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValidationError("data", "missing or not bytes")
    return data


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
        needed = request_schema_version(req)
        if req.v < needed:
            raise ValidationError("v", f"must be at least {needed} for a request with messages, tools or "
                                       f"return_text, got {req.v}")
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
        if req.resumable and req.return_text:
            raise ValidationError("return_text", "not with resumable (a resumed request's text would cover only "
                                                 "what it made after its checkpoint)")
        if req.meta_info and len(_encode_value(req.meta_info, "meta_info")) > limits.max_meta_bytes:
            raise ValidationError("meta_info", f"larger than {limits.max_meta_bytes} bytes")
    except ValidationError as exc:
        exc.request_id, exc.reply_to, exc.callback = req.request_id, req.reply_to, req.callback
        raise
    return req


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


# ---------------------------------------------------------------- records


def record_to_map(rec: CompletionRecord) -> dict[str, Any]:
    return msgspec.to_builtins(rec.data())


_DATA_NAMES = tuple(f.name for f in RECORD_DATA_FIELDS)
_STATUS_PAIR = {s: _ENCODER.encode("status") + _ENCODER.encode(s.value) for s in RecordStatus}
_STATUS_BYTES = {s: s.value.encode() for s in RecordStatus}
_WORKER_KEY = _ENCODER.encode("worker")


def _map_header(count: int) -> bytes:
    return bytes([0x80 | count]) if count < 16 else b"\xde" + count.to_bytes(2, "big")


# A CompletionRecord encodes as RecordData's map followed by two more pairs, ``status`` and
# ``worker`` (a subclass's fields follow its parent's): what _decode_with_plain_fields appends.
_DATA_HEADER = _map_header(len(_DATA_NAMES))
_RECORD_HEADER = _map_header(len(_DATA_NAMES) + 2)
_RECORD_HEADER_LEN = len(_RECORD_HEADER)


def encode_record(rec: CompletionRecord) -> dict[str, bytes]:
    """Encode a record into stream fields: ``rid``, ``status``, ``worker`` plain, ``data`` msgpack.

    ``data`` is the map of :class:`RecordData`'s fields in their order: the bytes ``rec.data()``
    encodes to, taken out of the record's own encoding (its header counted two pairs fewer, the
    ``status`` and ``worker`` pairs at its end cut off) instead of building a map or a struct
    first: the worker does this once per request."""
    whole = _ENCODER.encode(rec)
    tail = len(_STATUS_PAIR[rec.status]) + len(_WORKER_KEY) + len(_ENCODER.encode(rec.worker))
    return {
        "rid": rec.request_id.encode(),
        "status": _STATUS_BYTES[rec.status],
        "worker": (rec.worker or "").encode(),
        "data": b"".join((_DATA_HEADER, memoryview(whole)[_RECORD_HEADER_LEN:len(whole) - tail])),
    }


_STATUS_BY_FIELD: dict[Any, RecordStatus] = {
    **{s.value.encode(): s for s in RecordStatus}, **{s.value: s for s in RecordStatus}}
_STATUS_PAIR_BY_FIELD: dict[Any, bytes] = {k: _STATUS_PAIR[s] for k, s in _STATUS_BY_FIELD.items()}


def decode_record(fields: Mapping[Any, Any]) -> CompletionRecord:
    """Decode and validate a result entry. Raises only :class:`ValidationError`."""
    try:
        return _decode_record(fields)
    except RecursionError:  # (see TOO_DEEP)
        raise ValidationError("data", TOO_DEEP) from None


def _decode_record(fields: Mapping[Any, Any]) -> CompletionRecord:
    raw_status = _field(fields, "status")
    status = _STATUS_BY_FIELD.get(raw_status)
    if status is None:
        raise ValidationError("status", f"unknown status {_field_str(fields, 'status')!r}")
    data = _data(fields)
    worker = _field_str(fields, "worker") or None
    rec = _decode_with_plain_fields(data, _STATUS_PAIR_BY_FIELD[raw_status], _worker_pair(worker))
    if rec is None:  # the canonical path: the data map alone, then the record built from it
        try:
            wire = _RECORD_DECODER.decode(data)
        except msgspec.ValidationError as exc:  # (a subclass of DecodeError: first)
            raise _from_msgspec(exc) from None
        except msgspec.DecodeError as exc:
            raise ValidationError("data", f"not valid msgpack ({exc})") from None
        rec = CompletionRecord(status=status, worker=worker, **{f.name: getattr(wire, f.name) for f in _RECORD_FIELDS})
    ids = rec.output_token_ids
    if len(rec.finish_reasons) != len(ids):
        raise ValidationError("finish_reasons", "must be a list with one entry per sample")
    logprobs = rec.output_logprobs
    if logprobs is not None:
        if len(logprobs) != len(ids):
            raise ValidationError("output_logprobs", "must be a list with one entry per sample")
        for i, (lp, s) in enumerate(zip(logprobs, ids)):
            if len(lp) != len(s):
                raise ValidationError(f"output_logprobs[{i}]", "must have the same length as its token ids")
    versions = rec.weight_versions
    if versions is not None:
        if len(versions) != len(ids):
            raise ValidationError("weight_versions", "must be a list with one entry per sample")
        for i, (vs, s) in enumerate(zip(versions, ids)):
            if vs is not None and len(vs) != len(s):
                raise ValidationError(f"weight_versions[{i}]", "must have the same length as its token ids")
    _check_extras(rec)
    return rec


_RECORD_FIELDS = msgspec.structs.fields(RecordData)
_COMPLETION_DECODER = msgspec.msgpack.Decoder(CompletionRecord)


def _decode_with_plain_fields(data: Any, status_pair: bytes, worker_pair: bytes) -> CompletionRecord | None:
    """The record in one decode: the data map's header counts two more pairs, the entry's plain
    ``status`` and ``worker``, appended after its own (a later key wins, so a data map's own
    ``status`` or ``worker`` key changes nothing). None when that does not decode (not a map,
    trailing bytes, a bad value anywhere): then the canonical path decodes it and says why."""
    data = bytes(data)
    if data.startswith(_DATA_HEADER):  # (a map of RecordData's fields, as encode_record writes it)
        header, body = _RECORD_HEADER, len(_DATA_HEADER)
    else:
        head = data[:1]
        if not head:
            return None
        if 0x80 <= head[0] <= 0x8F:
            count, body = head[0] & 0x0F, 1
        elif head[0] == 0xDE:
            count, body = int.from_bytes(data[1:3], "big"), 3
        elif head[0] == 0xDF:
            count, body = int.from_bytes(data[1:5], "big"), 5
        else:
            return None
        count += 2
        if count > 0xFFFFFFFF:  # (not a map this header could count: the canonical path says why)
            return None
        header = b"\xde" + count.to_bytes(2, "big") if count < 0x10000 else b"\xdf" + count.to_bytes(4, "big")
    try:
        return _COMPLETION_DECODER.decode(b"".join((header, memoryview(data)[body:], status_pair, worker_pair)))
    except msgspec.DecodeError:
        return None


@functools.lru_cache(maxsize=1024)
def _worker_pair(worker: str | None) -> bytes:
    """The ``worker`` pair appended to a data map (a consumer reads the records of a few workers:
    built once per worker)."""
    return _WORKER_KEY + _ENCODER.encode(worker)


def _check_extras(data: RecordData) -> None:
    """The shapes of the per-request extras: one entry per sample, one per token."""
    ids = data.output_token_ids
    if data.output_text is not None and len(data.output_text) != len(ids):
        raise ValidationError("output_text", "must be a list with one entry per sample")
    top = data.output_top_logprobs
    if top is not None:
        if len(top) != len(ids):
            raise ValidationError("output_top_logprobs", "must be a list with one entry per sample")
        for i, (t, s) in enumerate(zip(top, ids)):
            if len(t) != len(s):
                raise ValidationError(f"output_top_logprobs[{i}]", "must have one entry per token id")
    routed = data.routed_experts
    if routed is not None:
        if len(routed) != len(ids):
            raise ValidationError("routed_experts", "must be a list with one entry per sample")
        for i, experts in enumerate(routed):
            if experts is None:
                continue
            tokens, layers, top_k = experts.shape
            if len(experts.data) != 4 * tokens * layers * top_k:
                raise ValidationError(f"routed_experts[{i}].data",
                                      f"must hold {tokens}x{layers}x{top_k} int32 values")

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
]
