"""Text in and out on the wire: chat ``messages``, ``tools`` and ``return_text`` on requests,
``output_text`` on records, and the schema-version rule (a request that uses a field of schema 2
is written as v 2; one that uses none stays v 1 so that older workers still run it)."""

from __future__ import annotations

import time
from typing import Any

import msgpack
import pytest

from redroll.cli.batch_run import InputError, request_from_line
from redroll.producer.client import make_request
from redroll.shared.codec import (
    Limits,
    NewerSchemaError,
    ValidationError,
    decode_messages,
    decode_record,
    decode_request,
    encode_record,
    encode_request,
    request_from_values,
)
from redroll.shared.types import (
    FIRST_SCHEMA_VERSION,
    SCHEMA_VERSION,
    TEXT_SCHEMA_VERSION,
    ChatMessage,
    CompletionRecord,
    GenerationRequest,
    RecordStatus,
    request_schema_version,
)

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


def wire(**over: Any) -> dict[bytes, bytes]:
    """Request stream fields for a map as a foreign producer might write it."""
    m: dict[str, Any] = {"v": TEXT_SCHEMA_VERSION, "request_id": "r1", "messages": CHAT, "submitted_at": time.time()}
    m.update(over)
    m = {k: v for k, v in m.items() if v is not ...}
    return {b"rid": b"r1", b"data": msgpack.packb(m, use_bin_type=True)}


def refusal(fields: dict[bytes, bytes], limits: Limits = Limits()) -> ValidationError:
    with pytest.raises(ValidationError) as ei:
        decode_request(fields, limits)
    assert "\n" not in str(ei.value)  # one line
    return ei.value


# ---------------------------------------------------------------- the version rule


def test_a_request_gets_the_lowest_version_that_carries_its_fields():
    assert TEXT_SCHEMA_VERSION == 2 and SCHEMA_VERSION == 5
    plain = [make_request(prompt="hi"), make_request(input_ids=[1, 2]),
             make_request(input_ids=[1], return_logprob=True, group_id="g")]
    for req in plain:
        assert request_schema_version(req) == FIRST_SCHEMA_VERSION
        assert decode_request(encode_request(req)).v == 1  # older workers still run it
    texty = [make_request(messages=CHAT), make_request(messages=CHAT, tools=TOOLS),
             make_request(prompt="hi", return_text=False), make_request(input_ids=[1], return_text=True)]
    for req in texty:
        assert request_schema_version(req) == TEXT_SCHEMA_VERSION
        assert decode_request(encode_request(req)).v == 2


def test_a_v1_request_that_uses_a_v2_field_is_refused_naming_v():
    # an older worker would drop the field without a word: such a map is invalid, not "v 1"
    for over in ({"messages": CHAT}, {"messages": ..., "prompt": "x", "return_text": True}):
        err = refusal(wire(v=1, **over))
        assert err.field == "v" and "at least 2" in err.rule


def test_a_worker_that_knows_only_v1_hands_a_v2_request_back():
    v1_only = Limits(schema_version=1)
    with pytest.raises(NewerSchemaError) as ei:
        decode_request(encode_request(make_request(request_id="chat-1", messages=CHAT)), v1_only)
    assert ei.value.field == "v" and "newer than 1" in str(ei.value) and ei.value.request_id == "chat-1"
    # even when the v2 map would be invalid for it in other ways (a field it does not know)
    with pytest.raises(NewerSchemaError):
        decode_request(wire(messages=[{"role": "user", "content": 3}]), v1_only)
    # and the requests it knows still decode
    assert decode_request(encode_request(make_request(prompt="hi")), v1_only).prompt == "hi"
    # the plain-values path (redroll submit's lines) decides the same way
    with pytest.raises(NewerSchemaError):
        request_from_values({"request_id": "x", "messages": CHAT, "v": 2}, v1_only)


# ---------------------------------------------------------------- validation


def test_exactly_one_of_input_ids_prompt_or_messages():
    for over in ({"prompt": "x"}, {"input_ids": [1]}, {"messages": ...}):
        err = refusal(wire(**over) if "messages" not in over else wire(messages=...))
        assert err.field == "input_ids/prompt/messages"
        assert err.rule == "exactly one of input_ids, prompt or messages is required"
    with pytest.raises(ValidationError) as ei:
        encode_request(GenerationRequest(request_id="a", prompt="x", messages=decode_messages(CHAT)))
    assert ei.value.field == "input_ids/prompt/messages"


@pytest.mark.parametrize(("messages", "field", "rule"), [
    ("hello", "messages", "Expected `array | null`, got `str`"),
    ([], "messages", "Expected `array` of length >= 1"),
    ([{"content": "x"}], "messages[0].role", "is required"),
    ([{"role": "", "content": "x"}], "messages[0].role", "Expected `str` of length >= 1"),
    ([{"role": "user", "content": 7}], "messages[0].content", "Expected `str | null`, got `int`"),
    ([{"role": "user", "content": "x", "image": "y"}], "messages[0].image", "unknown field"),
    ([{"role": "user", "content": "x"}, {"role": "user"}], "messages[1].content", "is required"),
    ([{"role": "user", "content": "x"}, "hi"], "messages[1]", "Expected `object`, got `str`"),
])
def test_the_shape_of_messages_is_checked_naming_the_field(messages, field, rule):
    err = refusal(wire(messages=messages))
    assert err.field == field
    assert err.rule.startswith(rule), err.rule
    assert str(err) == f"{field}: {err.rule}"


def test_an_assistant_turn_may_only_call_tools():
    calls = [{"type": "function", "function": {"name": "lookup", "arguments": "{}"}}]
    chat = CHAT + [{"role": "assistant", "tool_calls": calls}, {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    req = decode_request(wire(messages=chat, tools=TOOLS))
    assert req.messages[2] == ChatMessage(role="assistant", tool_calls=calls)
    assert req.tools == TOOLS


def test_tools_need_messages_and_return_text_is_refused_with_resumable():
    assert refusal(wire(messages=..., input_ids=[1], tools=TOOLS)).field == "tools"
    err = refusal(wire(messages=..., input_ids=[1], resumable=True, return_text=True))
    assert err.field == "return_text" and "resumable" in err.rule
    # nil means the default, as everywhere on the wire
    assert decode_request(wire(return_text=None)).return_text is None


def test_who_gets_text_by_default():
    assert make_request(prompt="hi").wants_text
    assert make_request(messages=CHAT).wants_text
    assert not make_request(input_ids=[1]).wants_text
    assert make_request(input_ids=[1], return_text=True).wants_text
    assert not make_request(messages=CHAT, return_text=False).wants_text


def test_make_request_takes_plain_messages_and_refuses_bad_ones_naming_the_field():
    req = make_request(messages=CHAT, tools=TOOLS, return_text=True)
    assert req.messages == [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="hi")]
    with pytest.raises(ValidationError) as ei:
        make_request(messages=[{"role": "user", "content": ["a", "b"]}])
    assert ei.value.field == "messages[0].content"
    with pytest.raises(ValidationError) as ei:
        make_request(messages="hi")
    assert ei.value.field == "messages"


def test_submit_lines_accept_messages():
    line = '{"request_id": "c1", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}'
    req = request_from_line(line, Limits())
    assert req.messages == [ChatMessage(role="user", content="hi")] and req.tools == [{"type": "function"}]
    assert decode_request(encode_request(req)).v == 2
    # the slow path (a nil somewhere) reads the line the same way
    assert request_from_line(line[:-1] + ', "return_text": null}', Limits()).messages == req.messages
    with pytest.raises(InputError, match=r"^invalid messages\[0\]\.role: is required$"):
        request_from_line('{"request_id": "c2", "messages": [{"content": "hi"}]}', Limits())


# ---------------------------------------------------------------- records


def test_records_carry_output_text_one_per_sample():
    rec = CompletionRecord(request_id="r1", status=RecordStatus.FINISHED, output_token_ids=[[1, 2], [3]],
                           finish_reasons=["stop", "length"], output_text=["ab", "c"], v=2)
    back = decode_record(encode_record(rec))
    assert back.output_text == ["ab", "c"] and back.v == 2
    bad = CompletionRecord(request_id="r1", status=RecordStatus.FINISHED, output_token_ids=[[1, 2], [3]],
                           finish_reasons=["stop", "length"], output_text=["ab"])
    with pytest.raises(ValidationError) as ei:
        decode_record(encode_record(bad))
    assert ei.value.field == "output_text"
    # a record without text reads as before: no output_text
    plain = CompletionRecord(request_id="r2", status=RecordStatus.FINISHED, output_token_ids=[[1]],
                             finish_reasons=["length"])
    assert decode_record(encode_record(plain)).output_text is None
