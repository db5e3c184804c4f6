"""The wire codec: round trips, every validation rule, and 'decoding never raises anything else'."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from redroll.shared.codec import (
    DEFAULT_LIMITS,
    TOO_DEEP,
    Limits,
    NewerSchemaError,
    ValidationError,
    check_request_id,
    decode_record,
    decode_request,
    decode_sampling_params,
    encode_record,
    encode_request,
    request_from_values,
    request_to_map,
)
from redroll.shared.types import (
    FIRST_SCHEMA_VERSION,
    SCHEMA_VERSION,
    CompletionRecord,
    GenerationRequest,
    RecordStatus,
    SamplingParams,
)

_DROP = object()


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def valid_map(**over: Any) -> dict[str, Any]:
    m: dict[str, Any] = {
        "v": 1,
        "request_id": "req-1",
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 8},
        "return_logprob": False,
        "collect_unfinished": False,
        "meta_info": {"k": "v"},
        "reply_to": "{ns}:results",
        "callback": None,
        "group_id": None,
        "deadline": None,
        "submitted_at": 1_700_000_000.5,
    }
    for k, v in over.items():
        if v is _DROP:
            m.pop(k, None)
        else:
            m[k] = v
    return m


def fields_of(m: Any, rid: str = "req-1") -> dict[bytes, bytes]:
    return {b"rid": rid.encode(), b"data": pack(m)}


def decode_map(m: Any, limits: Limits = DEFAULT_LIMITS) -> GenerationRequest:
    return decode_request(fields_of(m), limits)


def field_error(m: Any, limits: Limits = DEFAULT_LIMITS) -> ValidationError:
    with pytest.raises(ValidationError) as ei:
        decode_map(m, limits)
    return ei.value


def sp(**params: Any) -> dict[str, Any]:
    return valid_map(sampling_params=params)


# ---------------------------------------------------------------- round trips


def test_request_round_trip_full():
    req = GenerationRequest(
        request_id=f"{uuid.uuid4()}_12",
        input_ids=[0, 5, 2**31 - 1],
        sampling_params=SamplingParams(
            max_new_tokens=64, temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, stop=("\n\n", "END"),
            stop_token_ids=(2, 7), n=4, ignore_eos=True, repetition_penalty=1.1, sampling_seed=1234,
            json_schema="{}", logit_bias={"5": -1.0},
        ),
        return_logprob=True,
        collect_unfinished=True,
        meta_info={"step": 12, "domain": "math", "nested": {"a": [1, 2.5, None, b"raw"]}},
        reply_to="{ns}:reply:producer-1",
        callback="score",
        group_id="group_7",
        deadline=1_800_000_000.25,
        submitted_at=1_700_000_000.5,
        lora_path="/loras/a",
        model="qwen",
    )
    fields = encode_request(req)
    assert fields["rid"] == req.request_id.encode()
    assert fields["reply_to"] == b"{ns}:reply:producer-1"
    assert isinstance(fields["data"], bytes)
    back = decode_request(fields)
    assert back == req
    # str keys work as well as bytes keys
    assert decode_request({k: v for k, v in fields.items()}) == req
    assert decode_request({"rid": "x", "data": fields["data"]}) == req


def test_request_round_trip_minimal_prompt_defaults():
    req = GenerationRequest(request_id="p1", prompt="hello")
    fields = encode_request(req)
    assert b"reply_to" not in fields
    back = decode_request(fields)
    assert back == req
    assert back.sampling_params == SamplingParams()
    assert back.input_ids is None and back.prompt == "hello"
    assert back.v == FIRST_SCHEMA_VERSION  # (no field of a later schema: older workers run it)


def test_encode_refuses_invalid_request():
    with pytest.raises(ValidationError) as ei:
        encode_request(GenerationRequest(request_id="has space", prompt="x"))
    assert ei.value.field == "request_id"
    with pytest.raises(ValidationError) as ei:
        encode_request(GenerationRequest(request_id="ok", prompt="x", input_ids=[1]))
    assert ei.value.field == "input_ids/prompt/messages"
    with pytest.raises(ValidationError) as ei:
        encode_request(GenerationRequest(request_id="ok", prompt="x" * 300), Limits(max_payload_bytes=200))
    assert ei.value.field == "data"


def test_record_round_trip():
    rec = CompletionRecord(
        request_id="r-1",
        status=RecordStatus.FINISHED,
        output_token_ids=[[1, 2, 3], [4]],
        finish_reasons=["length", "stop"],
        output_logprobs=[[-0.1, -0.2, -3.0], [-0.5]],
        meta_info={"prompt_tokens": 3, "weight_version": "7"},
        error=None,
        worker="worker-a",
        callback="cb",
        group_id="g1",
    )
    fields = encode_record(rec)
    assert fields["rid"] == b"r-1" and fields["status"] == b"finished" and fields["worker"] == b"worker-a"
    assert decode_record(fields) == rec


@pytest.mark.parametrize("status", list(RecordStatus))
def test_failed_record_round_trip(status):
    req = GenerationRequest(request_id="r2", prompt="x", meta_info={"a": 1}, callback="cb", group_id="g",
                            sampling_params=SamplingParams(n=3))
    rec = CompletionRecord.failed(req, request_id="r2", status=status, error="boom" if status is RecordStatus.ERROR
                                  else None, worker="w", n=req.n, meta_info={"attempt": 2})
    back = decode_record(encode_record(rec))
    assert back == rec
    assert back.finish_reasons == [None, None, None]
    assert back.output_token_ids == [[], [], []]
    assert back.meta_info == {"a": 1, "attempt": 2}
    assert back.ok is (status is RecordStatus.FINISHED)


def test_record_without_worker_decodes_to_none():
    rec = CompletionRecord(request_id="r", status=RecordStatus.ABORTED, output_token_ids=[[]],
                           finish_reasons=[None])
    assert decode_record(encode_record(rec)).worker is None


# ---------------------------------------------------------------- request_id


@pytest.mark.parametrize(
    "rid",
    [
        f"{uuid.uuid4()}_12",
        "3f2b6c1e-9a4d-4c6b-8f3e-2a1b0c9d8e7f_0",
        "a",
        "x" * 128,
        "ns:thing/with.punct~|!@#$%^&*()[]<>?=+",
        "under_score-dash",
    ],
)
def test_request_id_accepted(rid):
    assert decode_map(valid_map(request_id=rid)).request_id == rid
    assert check_request_id(rid) == rid


@pytest.mark.parametrize(
    "rid",
    [
        _DROP,  # missing
        None,
        12345,
        b"bytes-id",
        ["a"],
        "",
        "x" * 129,
        "has space",
        "tab\there",
        "newline\nin",
        "trailing-newline\n",
        "\nleading",
        "cr\r",
        "brace{",
        "brace}",
        "{tag}",
        "non-ascii-é",
        "nul\x00",
        "del\x7f",
    ],
)
def test_request_id_rejected(rid):
    err = field_error(valid_map(request_id=rid))
    assert err.field == "request_id"
    assert "request_id" in err.reason
    assert not isinstance(err, NewerSchemaError)


# ---------------------------------------------------------------- inputs


def test_input_ids_and_prompt_both_or_neither():
    assert field_error(valid_map(prompt="hi")).field == "input_ids/prompt/messages"
    assert field_error(valid_map(input_ids=_DROP)).field == "input_ids/prompt/messages"
    assert field_error(valid_map(input_ids=None)).field == "input_ids/prompt/messages"
    ok = decode_map(valid_map(input_ids=_DROP, prompt="hi"))
    assert ok.prompt == "hi" and ok.input_ids is None
    ok = decode_map(valid_map(prompt=None))
    assert ok.input_ids == [1, 2, 3]


@pytest.mark.parametrize(
    "over, field",
    [
        ({"input_ids": "1 2 3"}, "input_ids"),
        ({"input_ids": {"a": 1}}, "input_ids"),
        ({"input_ids": 7}, "input_ids"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [1, "2"]}, "input_ids[1]"),
        ({"input_ids": [1.0]}, "input_ids[0]"),
        ({"input_ids": [True, 1]}, "input_ids[0]"),
        ({"input_ids": [1, None]}, "input_ids[1]"),
        ({"input_ids": [0, -1]}, "input_ids[1]"),
        ({"input_ids": [2**31]}, "input_ids[0]"),
        ({"input_ids": _DROP, "prompt": 5}, "prompt"),
        ({"input_ids": _DROP, "prompt": b"bytes"}, "prompt"),
        ({"input_ids": _DROP, "prompt": ["a"]}, "prompt"),
        ({"input_ids": _DROP, "prompt": ""}, "prompt"),
        ({"return_logprob": 1}, "return_logprob"),
        ({"return_logprob": "yes"}, "return_logprob"),
        ({"collect_unfinished": 0}, "collect_unfinished"),
        ({"sampling_params": [1, 2]}, "sampling_params"),
        ({"sampling_params": "greedy"}, "sampling_params"),
        ({"meta_info": [1, 2]}, "meta_info"),
        ({"meta_info": "x"}, "meta_info"),
        ({"meta_info": 5}, "meta_info"),
        ({"reply_to": 5}, "reply_to"),
        ({"reply_to": "x" * 513}, "reply_to"),
        ({"callback": ["f"]}, "callback"),
        ({"callback": "f" * 257}, "callback"),
        ({"group_id": "bad group"}, "group_id"),
        ({"group_id": 5}, "group_id"),
        ({"deadline": "soon"}, "deadline"),
        ({"deadline": [1]}, "deadline"),
        ({"deadline": True}, "deadline"),
        ({"deadline": float("nan")}, "deadline"),
        ({"deadline": float("inf")}, "deadline"),
        ({"submitted_at": _DROP}, "submitted_at"),
        ({"submitted_at": "now"}, "submitted_at"),
        ({"submitted_at": float("nan")}, "submitted_at"),
        ({"submitted_at": float("-inf")}, "submitted_at"),
        ({"submitted_at": True}, "submitted_at"),
        ({"lora_path": 3}, "lora_path"),
        ({"model": {"name": "x"}}, "model"),
    ],
)
def test_wrong_types(over, field):
    err = field_error(valid_map(**over))
    assert err.field == field, err
    assert field in err.reason


def test_string_fields_at_their_length_limits_pass():
    req = decode_map(valid_map(reply_to="r" * 512, callback="c" * 256, submitted_at=1_700_000_000))
    assert (len(req.reply_to), len(req.callback), req.submitted_at) == (512, 256, 1_700_000_000.0)


def test_input_ids_too_long():
    assert field_error(valid_map(input_ids=[1] * 11), Limits(max_input_tokens=10)).field == "input_ids"
    assert decode_map(valid_map(input_ids=[1] * 10), Limits(max_input_tokens=10)).input_ids == [1] * 10


def test_meta_info_limits():
    err = field_error(valid_map(meta_info={"blob": "x" * 200}), Limits(max_meta_bytes=100))
    assert err.field == "meta_info"
    assert decode_map(valid_map(meta_info=None)).meta_info == {}
    # int keys are refused already by the msgpack decoder (strict map keys)
    assert field_error(valid_map(meta_info={1: "a"})).field in ("data", "meta_info")


def test_deadline_accepts_int_and_float():
    assert decode_map(valid_map(deadline=1_800_000_000)).deadline == 1_800_000_000.0
    assert decode_map(valid_map(deadline=1.5)).deadline == 1.5


def test_optional_unknown_top_level_fields_are_ignored():
    req = decode_map(valid_map(future_field={"x": 1}, another=[1, 2]))
    assert req.request_id == "req-1"


# ---------------------------------------------------------------- sampling params


@pytest.mark.parametrize(
    "params, field",
    [
        ({"max_new_tokens": -1}, "sampling_params.max_new_tokens"),
        ({"max_new_tokens": 10**9}, "sampling_params.max_new_tokens"),
        ({"max_new_tokens": 2**64 - 1}, "sampling_params.max_new_tokens"),
        ({"max_new_tokens": 32769}, "sampling_params.max_new_tokens"),
        ({"max_new_tokens": 1.5}, "sampling_params.max_new_tokens"),
        ({"max_new_tokens": "8"}, "sampling_params.max_new_tokens"),
        ({"max_new_tokens": True}, "sampling_params.max_new_tokens"),
        ({"min_new_tokens": -1}, "sampling_params.min_new_tokens"),
        ({"min_new_tokens": 20, "max_new_tokens": 10}, "sampling_params.min_new_tokens"),
        ({"n": 0}, "sampling_params.n"),
        ({"n": 65}, "sampling_params.n"),
        ({"n": -3}, "sampling_params.n"),
        ({"n": True}, "sampling_params.n"),
        ({"n": 2.0}, "sampling_params.n"),
        ({"temperature": -1}, "sampling_params.temperature"),
        ({"temperature": -0.001}, "sampling_params.temperature"),
        ({"temperature": 100.5}, "sampling_params.temperature"),
        ({"temperature": float("nan")}, "sampling_params.temperature"),
        ({"temperature": float("inf")}, "sampling_params.temperature"),
        ({"temperature": "hot"}, "sampling_params.temperature"),
        ({"temperature": True}, "sampling_params.temperature"),
        ({"top_p": 0}, "sampling_params.top_p"),
        ({"top_p": 0.0}, "sampling_params.top_p"),
        ({"top_p": 1.5}, "sampling_params.top_p"),
        ({"top_p": 2}, "sampling_params.top_p"),
        ({"top_p": -0.5}, "sampling_params.top_p"),
        ({"top_p": float("nan")}, "sampling_params.top_p"),
        ({"top_k": 0}, "sampling_params.top_k"),
        ({"top_k": -2}, "sampling_params.top_k"),
        ({"top_k": 2**31}, "sampling_params.top_k"),
        ({"top_k": 1.0}, "sampling_params.top_k"),
        ({"top_k": False}, "sampling_params.top_k"),
        ({"min_p": -0.1}, "sampling_params.min_p"),
        ({"min_p": 1.1}, "sampling_params.min_p"),
        ({"repetition_penalty": 0}, "sampling_params.repetition_penalty"),
        ({"repetition_penalty": 2.5}, "sampling_params.repetition_penalty"),
        ({"repetition_penalty": -1.0}, "sampling_params.repetition_penalty"),
        ({"frequency_penalty": 3}, "sampling_params.frequency_penalty"),
        ({"presence_penalty": -2.5}, "sampling_params.presence_penalty"),
        ({"sampling_seed": -1}, "sampling_params.sampling_seed"),
        ({"sampling_seed": 2**64 - 1}, "sampling_params.sampling_seed"),
        ({"sampling_seed": True}, "sampling_params.sampling_seed"),
        ({"stop": ""}, "sampling_params.stop"),
        ({"stop": [""]}, "sampling_params.stop"),
        ({"stop": [1]}, "sampling_params.stop"),
        ({"stop": 5}, "sampling_params.stop"),
        ({"stop": ["s"] * 65}, "sampling_params.stop"),
        ({"stop_token_ids": [-5]}, "sampling_params.stop_token_ids[0]"),
        ({"stop_token_ids": [1, "x"]}, "sampling_params.stop_token_ids[1]"),
        ({"stop_token_ids": 3}, "sampling_params.stop_token_ids"),
        ({"ignore_eos": 1}, "sampling_params.ignore_eos"),
        ({"skip_special_tokens": "no"}, "sampling_params.skip_special_tokens"),
        ({"json_schema": {"type": "object"}}, "sampling_params.json_schema"),
        ({"stream_interval": True}, "sampling_params.stream_interval"),
        ({"no_stop_trim": 1}, "sampling_params.no_stop_trim"),
        ({"logit_bias": [1]}, "sampling_params.logit_bias"),
        ({"frobnicate": 1}, "sampling_params.frobnicate"),
        ({"best_of": 2}, "sampling_params.best_of"),
    ],
)
def test_sampling_params_rejected(params, field):
    err = field_error(sp(**params))
    assert err.field == field, err
    assert field in err.reason
    # the producer-side helper refuses exactly the same
    with pytest.raises(ValidationError) as ei:
        decode_sampling_params(params)
    assert ei.value.field == field


def test_sampling_params_accepted_edges():
    params = {
        "max_new_tokens": 0, "temperature": 0, "top_p": 1, "top_k": -1, "min_p": 1.0, "n": 64,
        "repetition_penalty": 2.0, "frequency_penalty": -2, "presence_penalty": 2, "sampling_seed": 2**63 - 1,
        "stop": "END", "stop_token_ids": [0, 2**31 - 1], "ignore_eos": False, "stream_interval": 4,
        "logit_bias": {"1": 0.5}, "regex": "[a-z]+", "stop_regex": ["x"], "unused_none_value": None,
    }
    got = decode_map(sp(**params)).sampling_params
    assert got.max_new_tokens == 0 and got.temperature == 0.0 and isinstance(got.temperature, float)
    assert got.top_p == 1.0 and got.top_k == -1 and got.n == 64 and got.stop == ("END",)
    assert got.stop_token_ids == (0, 2**31 - 1)
    assert got.sampling_seed == 2**63 - 1
    assert got.extra == {"stream_interval": 4, "logit_bias": {"1": 0.5}, "regex": "[a-z]+", "stop_regex": ["x"]}


def test_limits_bound_max_new_tokens_and_n():
    limits = Limits(max_new_tokens=100, max_n=4)
    assert decode_map(sp(max_new_tokens=100, n=4), limits).sampling_params.n == 4
    assert field_error(sp(max_new_tokens=101), limits).field == "sampling_params.max_new_tokens"
    assert field_error(sp(n=5), limits).field == "sampling_params.n"


# ---------------------------------------------------------------- payload and schema version


def test_oversize_payload():
    limits = Limits(max_payload_bytes=512)
    small = valid_map(input_ids=_DROP, prompt="x" * 100)
    assert decode_map(small, limits).prompt == "x" * 100
    err = field_error(valid_map(input_ids=_DROP, prompt="x" * 1000), limits)
    assert err.field == "data"
    assert "512" in err.reason
    # the payload limit is checked before anything else, so that a huge payload is not walked
    err = field_error([0] * 1000, limits)
    assert err.field == "data"


@pytest.mark.parametrize("v", [0, -1, "1", 1.0, None, True, [1], _DROP])
def test_schema_version_invalid(v):
    err = field_error(valid_map(v=v))
    assert err.field == "v"
    assert not isinstance(err, NewerSchemaError)


@pytest.mark.parametrize("v", [SCHEMA_VERSION + 1, 99, 2**40])
def test_schema_version_newer(v):
    err = field_error(valid_map(v=v, sampling_params={"brand_new_knob": 1}))
    assert isinstance(err, NewerSchemaError)
    assert isinstance(err, ValidationError)
    assert err.field == "v"
    assert err.request_id == "req-1"


def test_data_missing_or_not_bytes_or_not_msgpack_or_not_map():
    for fields in ({b"rid": b"a"}, {b"rid": b"a", b"data": "str-not-bytes"}, {b"rid": b"a", b"data": 5}):
        with pytest.raises(ValidationError) as ei:
            decode_request(fields)
        assert ei.value.field == "data"
    for data in (b"", b"\xc1", b"\x92\x01", b"not msgpack at all", pack([1, 2]), pack("str"), pack(None), pack(7)):
        with pytest.raises(ValidationError) as ei:
            decode_request({b"rid": b"rid-1", b"reply_to": b"{ns}:results", b"data": data})
        assert ei.value.field == "data", data
        # the waiter can still be told: request_id and reply_to come from the plain fields
        assert ei.value.request_id == "rid-1"
        assert ei.value.reply_to == "{ns}:results"


def test_error_carries_request_id_and_reply_to():
    err = field_error(valid_map(request_id="abc_1", reply_to="{ns}:reply:p", sampling_params={"n": 0}))
    assert (err.request_id, err.reply_to) == ("abc_1", "{ns}:reply:p")
    # unreadable request_id in the payload: fall back to a readable plain rid field
    with pytest.raises(ValidationError) as ei:
        decode_request({b"rid": b"plain-rid", b"reply_to": b"{ns}:results",
                        b"data": pack(valid_map(request_id="bad id", reply_to=None))})
    assert ei.value.field == "request_id"
    assert ei.value.request_id == "plain-rid"
    assert ei.value.reply_to == "{ns}:results"
    # no readable id anywhere: nobody to tell
    with pytest.raises(ValidationError) as ei:
        decode_request({b"rid": b"bad{rid}", b"data": b"\xc1"})
    assert ei.value.request_id is None and ei.value.reply_to is None
    with pytest.raises(ValidationError) as ei:
        decode_request({b"rid": b"\xff\xfe", b"data": b"\xc1"})
    assert ei.value.request_id is None


# ---------------------------------------------------------------- records


def valid_record_map(**over: Any) -> dict[str, Any]:
    m = {
        "v": 1, "request_id": "r1", "output_token_ids": [[1, 2], [3]], "finish_reasons": ["length", "stop"],
        "output_logprobs": [[-0.5, -1.0], [-2.0]], "meta_info": {}, "error": None, "callback": None,
        "group_id": None,
    }
    for k, v in over.items():
        if v is _DROP:
            m.pop(k, None)
        else:
            m[k] = v
    return m


def record_error(m: Any, status: Any = b"finished") -> ValidationError:
    fields = {b"rid": b"r1", b"worker": b"w", b"data": pack(m)}
    if status is not None:
        fields[b"status"] = status
    with pytest.raises(ValidationError) as ei:
        decode_record(fields)
    return ei.value


@pytest.mark.parametrize(
    "over, field",
    [
        ({"output_logprobs": [[-0.5], [-2.0]]}, "output_logprobs[0]"),
        ({"output_logprobs": [[-0.5, -1.0], []]}, "output_logprobs[1]"),
        ({"output_logprobs": [[-0.5, -1.0]]}, "output_logprobs"),
        ({"output_logprobs": "x"}, "output_logprobs"),
        ({"output_logprobs": [[-0.5, "a"], [-2.0]]}, "output_logprobs[0]"),
        ({"output_logprobs": [[-0.5, True], [-2.0]]}, "output_logprobs[0]"),
        ({"finish_reasons": ["eos", "stop"]}, "finish_reasons[0]"),
        ({"finish_reasons": ["length", 5]}, "finish_reasons[1]"),
        ({"finish_reasons": ["length"]}, "finish_reasons"),
        ({"finish_reasons": None}, "finish_reasons"),
        ({"output_token_ids": "1 2"}, "output_token_ids"),
        ({"output_token_ids": [[1, -2], [3]]}, "output_token_ids[0][1]"),
        ({"output_token_ids": [[1, 2], "3"]}, "output_token_ids[1]"),
        ({"request_id": "bad id"}, "request_id"),
        ({"request_id": _DROP}, "request_id"),
        ({"v": 0}, "v"),
        ({"v": "1"}, "v"),
        ({"meta_info": [1]}, "meta_info"),
        ({"error": 5}, "error"),
        ({"callback": 5}, "callback"),
    ],
)
def test_record_rejected(over, field):
    err = record_error(valid_record_map(**over))
    assert err.field == field, err


@pytest.mark.parametrize("status", [b"done", b"", b"FINISHED", None, b"\xff"])
def test_record_unknown_status(status):
    assert record_error(valid_record_map(), status=status).field == "status"


def test_record_data_not_msgpack_or_not_map():
    for data in (b"\xc1", pack([1])):
        with pytest.raises(ValidationError) as ei:
            decode_record({b"rid": b"r", b"status": b"error", b"data": data})
        assert ei.value.field == "data"
    with pytest.raises(ValidationError) as ei:
        decode_record({b"rid": b"r", b"status": b"error"})
    assert ei.value.field == "data"


def test_record_status_and_worker_come_from_the_plain_fields_only():
    # a data map's own status / worker keys (a foreign writer, a newer schema) change nothing
    data = pack(valid_record_map(status="bogus", worker="impostor", **{f"extra_{i}": i for i in range(20)}))
    assert data[0] == 0xDE  # a map16 header: more than 15 pairs
    rec = decode_record({b"rid": b"r1", b"status": b"aborted", b"worker": b"w", b"data": data})
    assert rec.status is RecordStatus.ABORTED and rec.worker == "w"
    rec = decode_record({b"rid": b"r1", b"status": b"finished", b"data": pack(valid_record_map(worker="x"))})
    assert rec.status is RecordStatus.FINISHED and rec.worker is None


def test_record_data_with_trailing_bytes_is_refused():
    for tail in (b"\xc0", pack("status") + pack("finished"), pack({"a": 1})):
        with pytest.raises(ValidationError) as ei:
            decode_record({b"rid": b"r", b"status": b"finished", b"data": pack(valid_record_map()) + tail})
        assert ei.value.field == "data" and "msgpack" in ei.value.rule


def deeply_nested(depth: int) -> bytes:
    """MessagePack of a one-element list in a list, ``depth`` deep: a few kB that take a recursive
    decoder past Python's recursion limit."""
    return b"\x91" * depth + b"\xc0"


def map_with_raw_value(m: dict[str, Any], key: str, raw: bytes) -> bytes:
    """MessagePack of ``m`` plus one more pair whose value is the bytes ``raw`` as they are."""
    packer = msgpack.Packer(use_bin_type=True)
    return (packer.pack_map_header(len(m) + 1) + b"".join(pack(k) + pack(v) for k, v in m.items())
            + pack(key) + raw)


@pytest.mark.parametrize("depth", [2_000, 200_000])
def test_deeply_nested_payloads_are_refused_not_raised(depth):
    # (a poison entry: before, RecursionError escaped the decoder, and a worker retried the entry forever)
    deep = deeply_nested(depth)
    for data in (deep, map_with_raw_value(valid_map(meta_info=_DROP), "meta_info", b"\x81\xa1k" + deep)):
        with pytest.raises(ValidationError) as ei:
            decode_request({b"rid": b"rid-1", b"reply_to": b"{ns}:results", b"data": data}, Limits(max_payload_bytes=10**6))
        assert (ei.value.field, ei.value.rule) == ("data", TOO_DEEP)
        assert (ei.value.request_id, ei.value.reply_to) == ("rid-1", "{ns}:results")  # (its waiter is told)
    for data in (deep, map_with_raw_value(valid_record_map(meta_info=_DROP), "meta_info", b"\x81\xa1k" + deep)):
        for worker in (b"w", None):
            fields = {b"rid": b"r", b"status": b"finished", b"data": data}
            if worker:
                fields[b"worker"] = worker
            with pytest.raises(ValidationError) as ei:
                decode_record(fields)
            assert ei.value.field == "data"
            # (a bare list is refused as not a map before its depth is seen)
            assert ei.value.rule == (TOO_DEEP if data is not deep else "Expected `object`, got `array`")


def test_record_map_header_counting_past_its_size_is_refused_not_raised():
    # (the record's one-decode path adds two pairs to the data map's count: a map32 at its largest
    # count has no header that can say so)
    for head in (b"\xdf\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xfe", b"\xdf\xff\xff\xff\xfd"):
        with pytest.raises(ValidationError) as ei:
            decode_record({b"rid": b"r", b"status": b"finished", b"worker": b"w", b"data": head + b"\xa1a\x01"})
        assert ei.value.field == "data" and "msgpack" in ei.value.rule


def test_values_messagepack_cannot_hold_are_refused_by_name():
    nested: Any = None
    for _ in range(5_000):
        nested = [nested]
    for meta, rule in (({"step": 2**64}, "64-bit range"), ({"step": -(2**63) - 1}, "64-bit range"),
                       ({"k": nested}, TOO_DEEP)):
        with pytest.raises(ValidationError) as ei:
            encode_request(GenerationRequest(request_id="big-1", input_ids=[1], meta_info=meta))
        assert ei.value.field == "data" and rule in ei.value.rule
        with pytest.raises(ValidationError) as ei:
            request_from_values({"request_id": "big-1", "input_ids": [1], "meta_info": meta})
        assert ei.value.field in ("data", "meta_info") and rule in ei.value.rule
    with pytest.raises(ValidationError) as ei:
        request_from_values({"request_id": "big-2", "input_ids": [1],
                             "sampling_params": {"custom_params": {"x": 2**70}}})
    assert "64-bit range" in ei.value.rule
    # the largest values that fit still pass
    req = decode_request(encode_request(GenerationRequest(request_id="fit-1", input_ids=[1],
                                                          meta_info={"a": 2**64 - 1, "b": -(2**63)})))
    assert req.meta_info == {"a": 2**64 - 1, "b": -(2**63)}


def test_record_accepts_nil_logprobs_and_nil_finish_reason():
    rec = decode_record({b"rid": b"r1", b"status": b"aborted", b"worker": b"w",
                         b"data": pack(valid_record_map(output_token_ids=[[]], finish_reasons=[None],
                                                        output_logprobs=None))})
    assert rec.finish_reasons == [None] and rec.output_logprobs is None
    assert rec.status is RecordStatus.ABORTED


# ---------------------------------------------------------------- property tests: only ValidationError

_scalars = (
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40) | st.binary(max_size=40)
)
_values = st.recursive(
    _scalars,
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=10) | st.binary(max_size=10), children, max_size=5),
    max_leaves=25,
)
_request_keys = st.sampled_from(
    ["v", "request_id", "input_ids", "prompt", "sampling_params", "return_logprob", "collect_unfinished",
     "meta_info", "reply_to", "callback", "group_id", "deadline", "submitted_at", "lora_path", "model"]
)
_sampling_keys = st.sampled_from(
    ["max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "n", "ignore_eos",
     "repetition_penalty", "sampling_seed", "min_new_tokens", "frequency_penalty", "presence_penalty",
     "skip_special_tokens", "json_schema", "stream_interval", "logit_bias", "stop_regex", "unknown"]
)
_record_keys = st.sampled_from(
    ["v", "request_id", "output_token_ids", "finish_reasons", "output_logprobs", "meta_info", "error",
     "callback", "group_id"]
)


@st.composite
def _request_like(draw):
    base = valid_map()
    # overwrite a few keys with random values, sometimes with a random sampling_params map
    for k, v in draw(st.dictionaries(_request_keys, _values, max_size=5)).items():
        base[k] = v
    if draw(st.booleans()):
        base["sampling_params"] = draw(st.dictionaries(_sampling_keys, _values, max_size=5))
    for k in draw(st.lists(_request_keys, max_size=3)):
        base.pop(k, None)
    return base


@st.composite
def _record_like(draw):
    base = valid_record_map()
    for k, v in draw(st.dictionaries(_record_keys, _values, max_size=5)).items():
        base[k] = v
    for k in draw(st.lists(_record_keys, max_size=3)):
        base.pop(k, None)
    return base


_PROP = hsettings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_small_limits = Limits(max_payload_bytes=256, max_meta_bytes=64, max_input_tokens=8, max_new_tokens=100, max_n=4)


def _only_validation_error(fn, *args):
    try:
        fn(*args)
    except ValidationError as exc:
        assert isinstance(exc.field, str) and exc.field
        assert isinstance(exc.reason, str)


@_PROP
@given(data=st.binary(max_size=300), rid=st.binary(max_size=20), status=st.binary(max_size=10))
def test_property_arbitrary_bytes(data, rid, status):
    fields = {b"rid": rid, b"data": data, b"reply_to": rid, b"status": status}
    _only_validation_error(decode_request, fields)
    _only_validation_error(decode_request, fields, _small_limits)
    _only_validation_error(decode_record, fields)
    _only_validation_error(decode_record, {**fields, b"status": b"finished"})


@_PROP
@given(value=_values)
def test_property_arbitrary_msgpack_values(value):
    data = pack(value)
    fields = {b"rid": b"r", b"data": data}
    _only_validation_error(decode_request, fields)
    _only_validation_error(decode_request, fields, _small_limits)
    _only_validation_error(decode_record, {**fields, b"status": b"finished"})
    _only_validation_error(decode_sampling_params, value)


@_PROP
@given(m=_request_like())
def test_property_request_like_maps(m):
    fields = {b"rid": b"r", b"data": pack(m)}
    for limits in (DEFAULT_LIMITS, _small_limits):
        try:
            req = decode_request(fields, limits)
        except ValidationError:
            continue
        assert isinstance(req, GenerationRequest)
        assert (req.input_ids is None) != (req.prompt is None)
        if limits is DEFAULT_LIMITS:
            # what decodes re-encodes and decodes to the same request (compared as msgpack: NaN in meta_info)
            again = decode_request(encode_request(req, limits), limits)
            assert pack(request_to_map(again)) == pack(request_to_map(req))


@_PROP
@given(m=_record_like(), status=st.sampled_from([s.value.encode() for s in RecordStatus]))
def test_property_record_like_maps(m, status):
    fields = {b"rid": b"r", b"status": status, b"worker": b"w", b"data": pack(m)}
    try:
        rec = decode_record(fields)
    except ValidationError:
        return
    assert len(rec.finish_reasons) == len(rec.output_token_ids)
    if rec.output_logprobs is not None:
        assert [len(x) for x in rec.output_logprobs] == [len(x) for x in rec.output_token_ids]
    assert isinstance(rec.status, RecordStatus)


@_PROP
@given(m=_record_like(), status=st.sampled_from(list(RecordStatus)),
       worker=st.one_of(st.none(), st.text(max_size=300)))
def test_property_a_records_data_is_exactly_record_datas_encoding(m, status, worker):
    # encode_record cuts the data map out of the whole record's encoding: the same bytes whatever
    # the record holds and whoever the worker is (a nil one, a long or non-ASCII name)
    try:
        rec = decode_record({b"rid": b"r", b"status": status.value.encode(), b"data": pack(m)})
    except ValidationError:
        return
    rec.worker = worker
    fields = encode_record(rec)
    assert fields["data"] == msgspec.msgpack.encode(rec.data())
    assert fields["status"] == status.value.encode() and fields["worker"] == (worker or "").encode()
    assert decode_record(fields) == rec if worker else decode_record(fields).worker is None


# ---------------------------------------------------------------- per-request extras (trainers)


def test_extras_need_return_logprob_and_fit_the_prompt():
    assert field_error(valid_map(top_logprobs_num=5)).field == "top_logprobs_num"
    assert field_error(valid_map(logprob_start_len=0)).field == "logprob_start_len"
    assert field_error(valid_map(return_logprob=True, top_logprobs_num=21)).field == "top_logprobs_num"
    error = field_error(valid_map(return_logprob=True, logprob_start_len=3))
    assert error.field == "logprob_start_len" and "prompt length (3)" in error.reason
    ok = decode_map(valid_map(return_logprob=True, top_logprobs_num=5, logprob_start_len=1,
                              return_routed_experts=True))
    assert (ok.top_logprobs_num, ok.logprob_start_len, ok.return_routed_experts) == (5, 1, True)


def test_records_carry_extras_in_shapes_the_reference_reader_sees():
    import array

    from redroll.shared.types import RoutedExperts

    experts = RoutedExperts(shape=(2, 1, 2), data=array.array("i", [1, 2, 3, 4]).tobytes())
    rec = CompletionRecord(request_id="r", status=RecordStatus.FINISHED, output_token_ids=[[5, 6]],
                           finish_reasons=["length"], output_logprobs=[[-0.1, -0.2]],
                           output_top_logprobs=[[[(5, -0.1), (7, -2.0)], [(6, -0.2), (8, -3.0)]]],
                           input_logprobs=[None, -1.5], routed_experts=[experts])
    fields = encode_record(rec)
    back = decode_record(fields)
    assert back == rec and back.routed_experts[0].to_list() == [[[1, 2]], [[3, 4]]]
    raw = msgpack.unpackb(fields["data"], raw=False)
    assert raw["output_top_logprobs"] == [[[[5, -0.1], [7, -2.0]], [[6, -0.2], [8, -3.0]]]]
    assert raw["input_logprobs"] == [None, -1.5]
    assert raw["routed_experts"] == [{"shape": [2, 1, 2], "data": experts.data}]
    # the data bytes are exactly RecordData's encoding (encode_record skips building that struct)
    assert fields["data"] == msgspec.msgpack.encode(rec.data())


@pytest.mark.parametrize("change, field", [
    ({"output_top_logprobs": [[[[5, -0.1]]]]}, "output_top_logprobs[0]"),
    ({"output_top_logprobs": []}, "output_top_logprobs"),
    ({"routed_experts": [{"shape": [2, 1, 2], "data": b"\0" * 12}]}, "routed_experts[0].data"),
    ({"routed_experts": [None, None]}, "routed_experts"),
])
def test_records_with_misshapen_extras_are_refused(change, field):
    data = {"v": 1, "request_id": "r", "output_token_ids": [[5, 6]], "finish_reasons": ["length"], **change}
    with pytest.raises(ValidationError) as ei:
        decode_record({b"rid": b"r", b"status": b"finished", b"data": pack(data)})
    assert ei.value.field == field


@_PROP
@given(m=_request_like())
def test_property_plain_values_are_refused_exactly_as_their_encoding(m):
    # request_from_values (redroll submit's JSON lines) takes what decode_request takes from the
    # same map's msgpack bytes, and refuses the rest naming the same field
    # A producer stamps a missing (or nil) v and submitted_at when it encodes: so does the wire map.
    stamped = {**m, "v": SCHEMA_VERSION if m.get("v") is None else m["v"],
               "submitted_at": 1.0 if m.get("submitted_at") is None else m["submitted_at"]}
    fields = {b"rid": b"r", b"data": pack(stamped)}
    # (the payload limit holds for the bytes a producer writes, every field encoded, not for this
    # sparse map's: compared apart below)
    for limits in (DEFAULT_LIMITS, dataclasses.replace(_small_limits, max_payload_bytes=1 << 20)):
        try:
            want: GenerationRequest | ValidationError = decode_request(fields, limits)
        except ValidationError as exc:
            want = exc
        try:
            got: GenerationRequest | ValidationError = request_from_values(m, limits)
        except ValidationError as exc:
            got = exc
        if isinstance(want, ValidationError):
            assert isinstance(got, ValidationError) and got.field == want.field, (got, want)
        else:
            assert isinstance(got, GenerationRequest), got
            got = msgspec.structs.replace(got, v=want.v, submitted_at=want.submitted_at)
            assert pack(request_to_map(got)) == pack(request_to_map(want))


def test_plain_values_over_the_payload_limit_are_refused_like_their_encoding():
    limits = Limits(max_payload_bytes=280)  # (a request encodes the fields it sets: about 130 and 430 bytes here)
    small, big = valid_map(meta_info={"x": "a"}), valid_map(meta_info={"x": "a" * 300})
    for m in (small, big):
        refused = []
        for make in (lambda: request_from_values(m, limits),
                     lambda: encode_request(msgspec.convert(m, GenerationRequest), limits)):
            try:
                make()
                refused.append(None)
            except ValidationError as exc:
                refused.append(exc.field)
        assert refused == ([None, None] if m is small else ["data", "data"])


# ---------------------------------------------------------------- refusals a person can act on


@pytest.mark.parametrize("rid", ["bad id", "x" * 129, "{tag}", "", "tab\there", "é", 5])
def test_a_refused_request_id_names_the_rule_in_words(rid):
    from redroll.shared.codec import request_from_values

    for err in (field_error(valid_map(request_id=rid)), record_error(valid_record_map(request_id=rid))):
        assert err.field == "request_id"
        assert "regex" not in err.rule and "[!-z" not in err.rule, err.rule
        assert "1-128 printable ASCII characters" in err.rule and "whitespace" in err.rule and "braces" in err.rule
    with pytest.raises(ValidationError, match="1-128 printable ASCII characters") as caught:
        request_from_values({"request_id": rid, "prompt": "x"})
    assert "regex" not in str(caught.value)


@pytest.mark.parametrize("v", [0, -1, "1", 1.0, None, True, [1], _DROP])
def test_the_schema_version_is_named_the_same_way_whatever_is_wrong(v):
    err = field_error(valid_map(v=v))
    assert (err.field, err.rule.split(",")[0]) == ("v", "schema version must be a positive integer"), err.rule


@pytest.mark.parametrize("v", [0, -1, "1", 1.0, None, True, [1]])
def test_a_records_schema_version_is_named_as_a_requests_is(v):
    err = record_error(valid_record_map(v=v))  # (a record that leaves v out is version 1)
    assert (err.field, err.rule.split(",")[0]) == ("v", "schema version must be a positive integer"), err.rule


# ---------------------------------------------------------------- schema 4: prompt ids and chat templates

_CHAT = [{"role": "user", "content": "a b"}]


@pytest.mark.parametrize("fields", [{"return_prompt_token_ids": True}, {"chat_template": "{{ messages }}"},
                                    {"chat_template_kwargs": {"enable_thinking": False}}])
def test_a_request_with_a_schema_4_field_is_stamped_4_and_a_v3_worker_hands_it_back(fields):
    body = {"messages": _CHAT} if "chat_template" in next(iter(fields)) else {"prompt": "x"}
    req = GenerationRequest(request_id="s4", **body, **fields)
    wire = encode_request(req)
    assert decode_request(wire).v == 4 == SCHEMA_VERSION - 1
    with pytest.raises(NewerSchemaError) as ei:  # (a worker of schema 3 would drop the field without a word)
        decode_request(wire, Limits(schema_version=3))
    assert ei.value.field == "v" and ei.value.request_id == "s4"
    # a map that claims an older version than its fields need is refused naming v
    err = field_error(valid_map(v=3, input_ids=_DROP, **body, **fields))
    assert err.field == "v" and "at least 4" in err.rule and "return_prompt_token_ids" in err.rule
    # (return_prompt_token_ids false, the default, needs nothing newer)
    assert decode_request(encode_request(GenerationRequest(request_id="s1", prompt="x"))).v == 1


_TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("fields", [{"messages": _CHAT, "tools": _TOOLS, "tool_choice": "required"},
                                    {"messages": _CHAT, "prefix_ids": [1, 2]}, {"prompt": "x", "prefix_ids": [3]}])
def test_a_request_with_a_schema_5_field_is_stamped_5_and_a_v4_worker_hands_it_back(fields):
    req = GenerationRequest(request_id="s5", **fields)
    wire = encode_request(req)
    assert decode_request(wire).v == 5 == SCHEMA_VERSION
    with pytest.raises(NewerSchemaError) as ei:
        decode_request(wire, Limits(schema_version=4))
    assert ei.value.field == "v" and ei.value.request_id == "s5"
    err = field_error(valid_map(v=4, input_ids=_DROP, **fields))
    assert err.field == "v" and "at least 5" in err.rule and "tool_choice or prefix_ids" in err.rule


def test_tool_choice_needs_tools_and_names_one_of_them_and_prefix_ids_goes_with_text():
    named = {"type": "function", "function": {"name": "add"}}
    assert decode_request(encode_request(GenerationRequest(request_id="t", messages=_CHAT, tools=_TOOLS,
                                                           tool_choice=named))).tool_choice == named
    for fields, field, rule in (
            ({"messages": _CHAT, "tool_choice": "auto"}, "tool_choice", "needs tools"),
            ({"messages": _CHAT, "tools": _TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}},
             "tool_choice.function.name", "'mul' is not one of the tools"),
            ({"messages": _CHAT, "tools": _TOOLS, "tool_choice": {"function": {"name": "add"}}}, "tool_choice",
             "a named choice is"),
            ({"prefix_ids": [1]}, "prefix_ids", "goes with messages or prompt")):
        body = fields if "messages" in fields else {**fields}
        err = field_error(valid_map(v=5, **({"input_ids": _DROP} if "messages" in body else {}), **body))
        assert err.field == field and rule in err.rule, err
    err = field_error(valid_map(v=5, input_ids=_DROP, messages=_CHAT, tools=_TOOLS, tool_choice="sometimes"))
    assert err.field == "tool_choice"


def test_chat_template_fields_need_messages_and_kwargs_are_template_variables_only():
    for name, value in (("chat_template", "{{ x }}"), ("chat_template_kwargs", {"x": 1})):
        err = field_error(valid_map(v=4, **{name: value}))
        assert (err.field, err.rule) == (name, "needs messages (it is handed to the chat template)")
    for key in ("tokenize", "add_generation_prompt", "chat_template", "tools"):
        err = field_error(valid_map(v=4, input_ids=_DROP, messages=_CHAT, chat_template_kwargs={key: True}))
        assert err.field == f"chat_template_kwargs.{key}" and "set by the worker" in err.rule
    err = field_error(valid_map(v=4, input_ids=_DROP, messages=_CHAT, chat_template_kwargs={"not a name": 1}))
    assert err.field == "chat_template_kwargs" and "template variable name" in err.rule
    err = field_error(valid_map(v=4, input_ids=_DROP, messages=_CHAT, chat_template="x" * 65_537))
    assert err.field == "chat_template"
    ok = decode_map(valid_map(v=4, input_ids=_DROP, messages=_CHAT, chat_template="{{ messages[0].content }}",
                              chat_template_kwargs={"enable_thinking": False, "depth": [1, {"a": None}]}))
    assert ok.chat_template_kwargs == {"enable_thinking": False, "depth": [1, {"a": None}]}


def test_a_record_carries_the_prompt_token_ids_and_an_older_reader_skips_them():
    rec = CompletionRecord(request_id="r", status=RecordStatus.FINISHED, output_token_ids=[[5]],
                           finish_reasons=["stop"], prompt_token_ids=[1, 2, 3], worker="w")
    fields = encode_record(rec)
    assert decode_record(fields).prompt_token_ids == [1, 2, 3]
    assert msgpack.unpackb(fields["data"])["prompt_token_ids"] == [1, 2, 3]  # (a plain MessagePack map)

    class OlderRecord(msgspec.Struct):  # (a reader from before the field: unknown keys are skipped)
        request_id: str
        output_token_ids: list[list[int]]

    assert msgspec.msgpack.decode(fields["data"], type=OlderRecord).output_token_ids == [[5]]
    with pytest.raises(ValidationError) as ei:
        decode_record({b"rid": b"r", b"status": b"finished",
                       b"data": pack(valid_record_map(prompt_token_ids=[1, -2]))})
    assert ei.value.field == "prompt_token_ids[1]"
