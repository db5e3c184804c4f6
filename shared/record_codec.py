"""The MessagePack codec of result entries (records): the stream-field envelope (plain ``rid``,
``status``, ``worker`` beside ``data``) encoded without building a map, and decoded in one msgspec
pass, with the per-sample shapes a static schema cannot say checked here. Raises only
:class:`~.validation.ValidationError`."""

from __future__ import annotations

import functools
from typing import Any, Mapping

import msgspec

from redroll.shared.types import RECORD_DATA_FIELDS, CompletionRecord, RecordData, RecordStatus
from redroll.shared.validation import TOO_DEEP, ValidationError, _data, _field, _field_str, _from_msgspec

_ENCODER = msgspec.msgpack.Encoder()
_RECORD_DECODER = msgspec.msgpack.Decoder(RecordData)


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
    _per_sample("output_logprobs", rec.output_logprobs, ids, "must have the same length as its token ids")
    _per_sample("weight_versions", rec.weight_versions, ids, "must have the same length as its token ids")
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


def _per_sample(name: str, values: list | None, ids: list[list[int]], per_token: str | None = None) -> None:
    """``values`` (None: absent) has one entry per sample; with ``per_token`` (the message), each
    entry that is not None has one per token id of its sample."""
    if values is None:
        return
    if len(values) != len(ids):
        raise ValidationError(name, "must be a list with one entry per sample")
    if per_token is not None:
        for i, (v, s) in enumerate(zip(values, ids)):
            if v is not None and len(v) != len(s):
                raise ValidationError(f"{name}[{i}]", per_token)


def _check_extras(data: RecordData) -> None:
    """The shapes of the per-request extras: one entry per sample, one per token."""
    ids = data.output_token_ids
    _per_sample("output_text", data.output_text, ids)
    _per_sample("tool_calls", data.tool_calls, ids)
    _per_sample("output_top_logprobs", data.output_top_logprobs, ids, "must have one entry per token id")
    routed = data.routed_experts
    _per_sample("routed_experts", routed, ids)
    if routed is not None:
        for i, experts in enumerate(routed):
            if experts is None:
                continue
            tokens, layers, top_k = experts.shape
            if len(experts.data) != 4 * tokens * layers * top_k:
                raise ValidationError(f"routed_experts[{i}].data",
                                      f"must hold {tokens}x{layers}x{top_k} int32 values")
