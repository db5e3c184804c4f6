"""Shared by the agent tests: one tool-calling episode (what is 2 + 3? the tool says 5) scripted in
each parser family, as a synthetic script file and as a tiny checkpoint that learned to say it."""

from __future__ import annotations

import json
from pathlib import Path

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "a + b",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["a", "b"], "additionalProperties": False}}}]
QUESTION = [{"role": "user", "content": "What is 2+3?"}]
ARGUMENTS = {"a": 2, "b": 3}
ANSWER = "2 + 3 = 5."

CALL_TEXT = {"hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
             "llama3_json": '{"name": "add", "parameters": {"a": 2, "b": 3}}'}
"""The model's tool call as each family writes it."""

CARD_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["color", "name", "tags"],
               "properties": {"color": {"enum": ["red", "green", "blue"]},
                              "name": {"type": "string", "maxLength": 8},
                              "tags": {"type": "array", "maxItems": 2,
                                       "items": {"type": "string", "maxLength": 4}}}}
"""A bounded strict JSON schema (enums, ``maxLength``, ``maxItems``): what the structured-output
tests hold a random-weight model's completions to."""


def valid_card(text: str) -> bool:
    """Whether ``text`` parses as JSON and validates against :data:`CARD_SCHEMA`."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), CARD_SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def streamed_message(client, **kw) -> tuple[str, list[dict], str | None]:
    """A streamed chat (``client``: an ``openai.AsyncOpenAI``) rebuilt as OpenAI's SDK users do:
    content concatenated, tool calls accumulated by index; and its finish reason."""
    content, calls, finish = "", {}, None
    async for chunk in await client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or ():
                slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                if tc.function is not None:
                    slot["name"] = tc.function.name or slot["name"]
                    slot["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def after_call(call_id: str) -> list[dict]:
    """The conversation once the model called ``add`` and the tool answered."""
    call = {"id": call_id, "type": "function", "function": {"name": "add", "arguments": json.dumps(ARGUMENTS)}}
    return QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": call_id, "content": "5"}]


def script_file(directory: Path, family: str) -> Path:
    """The synthetic engine's script: the call, then the answer."""
    path = directory / f"script-{family}.json"
    path.write_text(json.dumps([CALL_TEXT[family], ANSWER]))
    return path


def scripted_checkpoint(directory: Path, family: str) -> Path:
    """A tiny ``family`` checkpoint that says the call to the question and the answer to the tool's result
    (the template renders a call's arguments as sent back, so any call id gives the same prompt)."""
    from redroll.engine_worker.engines.tiny_agent import save_agent_checkpoint

    return save_agent_checkpoint(directory / f"tiny-{family}", family, scripted=[
        (QUESTION, TOOLS, CALL_TEXT[family]), (after_call("call_x"), TOOLS, ANSWER)])

