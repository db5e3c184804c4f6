"""Tool calls and structured output on the vLLM engine, through the door with the official ``openai``
SDK and through the Python API, on the session's vLLM worker (tiny random model, ``--tool-call-parser
hermes``: tests/vllm/conftest.py).

* A ``required`` and a named ``tool_choice`` return valid calls: vLLM's structured outputs (the
  JSON schema vLLM's parser asks for, on llguidance) made the model write them, vLLM's parser
  (``hermes``, through its ``Parser.parse``) read them back.
* With a bounded strict ``json_schema`` (enums, ``maxLength``, ``maxItems``), 50 completions of the
  random-weight model all parse, validate and end with ``stop``; without it, most do not. The
  logprobs are the masked distribution (a token the grammar forces has logprob 0).
* ``regex`` and ``ebnf`` (vLLM's ``structured_outputs``) constrain the text too.
"""

from __future__ import annotations

import json
import re

import pytest
import pytest_asyncio

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from tests.agents_support import CARD_SCHEMA, streamed_message, valid_card  # noqa: E402

pytestmark = pytest.mark.asyncio(loop_scope="module")

PARAMETERS = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "b": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": PARAMETERS}},
         {"type": "function", "function": {"name": "echo", "parameters": {
             "type": "object", "properties": {"text": {"type": "string", "maxLength": 6}}, "required": ["text"],
             "additionalProperties": False}}}]
QUESTION = [{"role": "user", "content": "What is 2+3?"}]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(vllm_gateway):
    c = openai.AsyncOpenAI(base_url=vllm_gateway.served.v1, api_key="unused", max_retries=0, timeout=300)
    yield c
    await c.close()


def check_calls(calls: list[dict], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call["name"] in names and call["id"].startswith("call_")
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call["name"])
        jsonschema.validate(json.loads(call["arguments"]), schema)


async def test_required_and_named_choices_return_valid_calls(client, vllm_gateway):
    """Must-show 1 (vLLM): sampled at temperature 1 from a random model, every call validates
    against its tool's schema; finish_reason tool_calls for required, stop for named (OpenAI's rule)."""
    named = {"type": "function", "function": {"name": "add"}}
    for choice, names, reason in (("required", {"add", "echo"}, "tool_calls"), (named, {"add"}, "stop")):
        kw = dict(model=vllm_gateway.model, messages=QUESTION, tools=TOOLS, tool_choice=choice, temperature=1.0,
                  seed=5, max_tokens=200)
        out = await client.chat.completions.create(n=4, **kw)
        for c in out.choices:
            assert c.finish_reason == reason, c
            check_calls([{"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
                         for t in c.message.tool_calls], names)
        _, calls, finish = await streamed_message(client, **kw)
        assert finish == reason
        check_calls(calls, names)


async def test_the_python_api_reads_the_calls_vllms_parser_read(vllm_gateway):
    from redroll.producer.client import Producer

    async with Producer(vllm_gateway.settings, block_ms=200) as producer:
        rec = await producer.generate(messages=QUESTION, tools=TOOLS, tool_choice="required", return_text=True,
                                      parallel_tool_calls=False, timeout=300,
                                      sampling_params={"max_new_tokens": 200, "temperature": 1.0,
                                                       "sampling_seed": 1})
    assert rec.ok and rec.finish_reasons == ["stop"]
    (sample,) = rec.tool_calls
    assert len(sample.calls) == 1  # (parallel_tool_calls false: one call)
    check_calls([{"id": c.id, "name": c.name, "arguments": c.arguments} for c in sample.calls], {"add", "echo"})
    # what vLLM's parser asked the model for (compact JSON of the tool's schema) and read back
    (written,) = json.loads(rec.output_text[0])
    assert (written["name"], json.dumps(written["parameters"], ensure_ascii=False)) == (
        sample.calls[0].name, sample.calls[0].arguments)


async def test_fifty_completions_under_a_bounded_schema_all_validate_and_stop(client, vllm_gateway):
    """Must-show 2 (vLLM): 50 sampled completions under a strict json_schema all validate and
    stop; without it most do not (the grammar did it). The logprobs are the masked distribution:
    the forced first token ``{`` has logprob 0 exactly."""
    kw = dict(model=vllm_gateway.model, messages=QUESTION, n=50, temperature=1.0, seed=7, max_tokens=160)
    fmt = {"type": "json_schema", "json_schema": {"name": "card", "strict": True, "schema": CARD_SCHEMA}}
    out = await client.chat.completions.create(response_format=fmt, logprobs=True, **kw)
    assert [c.finish_reason for c in out.choices] == ["stop"] * 50
    assert all(valid_card(c.message.content) for c in out.choices), [c.message.content for c in out.choices]
    assert len({c.logprobs.content[0].token for c in out.choices}) == 1  # (the gateway names it token_id:N)
    assert {c.logprobs.content[0].logprob for c in out.choices} == {0.0}
    free = await client.chat.completions.create(**kw)
    assert sum(valid_card(c.message.content) for c in free.choices) == 0  # (a random model writes no such JSON)


async def test_regex_and_ebnf_through_structured_outputs(client, vllm_gateway):
    kw = dict(model=vllm_gateway.model, prompt="x", n=8, temperature=1.0, seed=3, max_tokens=40)
    out = await client.completions.create(extra_body={"structured_outputs": {"regex": "[ab]{3,5}c"}}, **kw)
    assert all(re.fullmatch("[ab]{3,5}c", c.text) and c.finish_reason == "stop" for c in out.choices), [
        (c.text, c.finish_reason) for c in out.choices]
    grammar = 'root ::= "x" [0-9] [0-9]? [0-9]? "y"'  # (bounded: a random model may never leave [0-9]+)
    out = await client.completions.create(extra_body={"structured_outputs": {"grammar": grammar}}, **kw)
    assert all(re.fullmatch("x[0-9]{1,3}y", c.text) and c.finish_reason == "stop" for c in out.choices), [
        (c.text, c.finish_reason) for c in out.choices]
