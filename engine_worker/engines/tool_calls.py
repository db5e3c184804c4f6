"""Tool calls read out of a sample's text: the parser families of the transformers and synthetic
engines, and what every engine shares (the tool choice's rules, the calls' ids, the schema a
required or named choice constrains the output to).

vLLM and SGLang parse with their own parsers (``--tool-call-parser``: vLLM's ``ToolParserManager``,
see :mod:`.vllm_tools`). The transformers and synthetic engines have none, and no maintained
pure-Python package parses these formats without pulling in vLLM or SGLang (PyPI's
"function-calling" packages are stubs or client-side helpers), so this module ports the two
families every open chat model of note uses, with the exact rules of vLLM's parsers of the same
name (``vllm/tool_parsers/hermes_tool_parser.py`` and ``llama_tool_parser.py``, 0.32):

* ``hermes`` (Hermes 2 Pro, Qwen 2.5 / 3, and any model whose template asks for
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``): every ``<tool_call>`` region is
  one call (an unclosed last one too); the text before the first is the content.
* ``llama3_json`` (Llama 3.1 / 3.2 / 3.3 / 4 JSON tool calling): every top-level JSON object in
  the text with ``name`` and ``arguments`` (or ``parameters``) is one call, after an optional
  ``<|python_tag|>``; the content is then empty.

A text that does not parse is content (no calls), as vLLM answers. ``tool_choice`` ``required``
and a named function are not parsed with the family: the output was constrained to a JSON
schema (:func:`tool_choice_schema`, vLLM's ``get_json_schema_from_tools``), so it *is* the calls
(a named choice: the arguments object; ``required``: ``[{"name", "parameters"}, ...]``).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Callable

from redroll.shared.codec import named_tool
from redroll.shared.types import GenerationRequest, SampleToolCalls, ToolCall

Calls = list[tuple[str, str]]
"""(function name, arguments as JSON text) per call."""


def _hermes(text: str) -> tuple[Calls, str | None] | None:
    start = "<tool_call>"
    if start not in text:
        return None
    try:
        calls = []
        for closed, unclosed in re.findall(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", text, re.DOTALL):
            obj = json.loads(closed or unclosed)
            calls.append((obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)))
    except (ValueError, KeyError, TypeError):
        return None
    content = text[:text.find(start)]
    return calls, content or None


def _llama3_json(text: str) -> tuple[Calls, str | None] | None:
    if "<|python_tag|>" not in text and "{" not in text:
        return None
    decoder = json.JSONDecoder()
    calls: Calls = []
    end = -1
    for match in re.finditer(r"\{", text):
        at = match.start()
        if at <= end:
            continue  # (inside an object already read)
        try:
            obj, length = decoder.raw_decode(text[at:])
        except ValueError:
            return None
        end = at + length
        try:
            arguments = obj["arguments"] if "arguments" in obj else obj["parameters"]
            calls.append((obj["name"], json.dumps(arguments, ensure_ascii=False)))
        except (KeyError, TypeError):
            return None
    return (calls, None) if calls else None


PARSERS: dict[str, Callable[[str], tuple[Calls, str | None] | None]] = {
    "hermes": _hermes,
    "llama3_json": _llama3_json,
}
"""Each family by the name ``--tool-call-parser`` takes (vLLM's names)."""

START_MARKERS: dict[str, tuple[str, ...]] = {"hermes": ("<tool_call>",), "llama3_json": ("<|python_tag|>", "{")}
"""Where a call may start in each family's text (the gateway holds streamed content from there)."""


def call_id(request_id: str, sample: int, index: int) -> str:
    """A call's id: the same on every attempt and every gateway replica (from the request_id, the
    sample and the call's index), shaped as OpenAI's (``call_`` and 24 hex digits)."""
    return "call_" + hashlib.sha256(f"{request_id}|{sample}|{index}".encode()).hexdigest()[:24]


def wants_calls(request: GenerationRequest) -> bool:
    """Whether a sample's text is read for tool calls: ``tools``, and a choice other than ``none``."""
    return request.tools is not None and request.tool_choice != "none"


def constrains(request: GenerationRequest) -> bool:
    """Whether the tool choice constrains the output (``required`` or a named function)."""
    return request.tools is not None and (request.tool_choice == "required" or isinstance(request.tool_choice, dict))


def tool_choice_schema(request: GenerationRequest) -> dict[str, Any] | None:
    """The JSON schema a ``required`` or named choice constrains the output to, as vLLM builds it
    (``vllm/tool_parsers/utils.py`` ``get_json_schema_from_tools``): a named function's parameters
    (an empty object when it has none); for ``required``, an array of at least one
    ``{"name": <one of the tools>, "parameters": <its parameters>}``. None otherwise."""
    if not constrains(request):
        return None
    functions = [t.get("function") or {} for t in request.tools or () if isinstance(t, dict)]

    def params(function: dict[str, Any]) -> dict[str, Any]:
        value = function.get("parameters")
        return value if value else {"type": "object", "properties": {}}

    name = named_tool(request.tool_choice)
    if name is not None:
        return params(next(f for f in functions if f.get("name") == name))
    return {"type": "array", "minItems": 1, **({"maxItems": 1} if request.parallel_tool_calls is False else {}),
            "items": {"type": "object", "anyOf": [
                {"properties": {"name": {"type": "string", "enum": [f.get("name")]}, "parameters": params(f)},
                 "required": ["name", "parameters"]} for f in functions]}}


def constrained_calls(request: GenerationRequest, text: str) -> Calls | None:
    """The calls of a sample whose output a ``required`` or named choice constrained (vLLM's
    reading: ``vllm/parser/abstract_parser.py`` ``_extract_tool_calls``); None when the text is not
    what the schema asked for (a sample cut short by ``max_tokens``)."""
    name = named_tool(request.tool_choice)
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if name is not None:  # (the text is the arguments, as vLLM takes it)
        return [(name, text.strip())] if isinstance(value, dict) else None
    if not isinstance(value, list):
        return None
    calls = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or "parameters" not in item:
            return None
        calls.append((item["name"], json.dumps(item["parameters"], ensure_ascii=False)))
    return calls


def as_tool_calls(request_id: str, sample: int, calls: Calls | None, content: str | None) -> SampleToolCalls | None:
    """The record's entry for one sample (None when it made no call)."""
    if not calls:
        return None
    return SampleToolCalls(calls=[ToolCall(id=call_id(request_id, sample, i), name=name, arguments=arguments)
                                  for i, (name, arguments) in enumerate(calls)], content=content)


class FamilyParser:
    """The tool-call parser of the transformers and synthetic engines: one family of :data:`PARSERS`."""

    def __init__(self, name: str):
        if name not in PARSERS:
            raise ValueError(f"unknown tool-call parser {name!r}: one of {', '.join(PARSERS)}")
        self.name = name
        self._parse = PARSERS[name]

    def parse(self, request: GenerationRequest, sample: int, text: str) -> SampleToolCalls | None:
        """One sample's calls (``text``: its output decoded with special tokens kept)."""
        return read_calls(request, sample, text, self._parse)


def read_calls(request: GenerationRequest, sample: int, text: str,
               family: Callable[[str], tuple[Calls, str | None] | None] | None) -> SampleToolCalls | None:
    """One sample's calls: a constrained choice read as its schema says, else with ``family``
    (None: no parser, the text stays text)."""
    if not wants_calls(request):
        return None
    if constrains(request):
        return as_tool_calls(request.request_id, sample, constrained_calls(request, text), None)
    if family is None:
        return None
    found = family(text)
    if found is None:
        return None
    calls, content = found
    return as_tool_calls(request.request_id, sample, calls, content)


def parser_text(tokenizer: Any, token_ids: list[int], stop_ids: frozenset[int] | set[int]) -> str:
    """The text a parser reads: the sample decoded with special tokens kept (a family's markers may
    be special tokens), without the stop token that ended it."""
    ids = list(token_ids)
    if ids and ids[-1] in stop_ids:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


__all__ = ["FamilyParser", "PARSERS", "START_MARKERS", "as_tool_calls", "call_id", "constrained_calls",
           "constrains", "parser_text", "read_calls", "tool_choice_schema", "wants_calls"]
