"""The transformers engine's structured output and tool calls (a mixin of
:class:`.transformers_engine.TransformersEngine`): a grammar per row (:mod:`.grammar`, llguidance)
masking each step, and the tool-call parser family of ``--tool-call-parser`` (:mod:`.tool_calls`)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from redroll.engine_worker.engines.base import EngineInfo
from redroll.engine_worker.engines.grammar import GrammarCompiler, continued_output, structured_key
from redroll.engine_worker.engines.tool_calls import PARSERS, parser_text, read_calls
from redroll.engine_worker.engines.transformers_batch import _Row
from redroll.shared.codec import ValidationError
from redroll.shared.types import GenerationRequest, SampleToolCalls

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


class TransformersStructured:
    """Mixin: needs the engine's tokenizer, vocabulary and end-of-sequence ids."""

    info: EngineInfo
    _tokenizer: Any
    _eos_ids: frozenset[int]
    _compiler: GrammarCompiler | None = None
    tool_call_parser: str | None = None

    def _set_tool_call_parser(self, name: str | None) -> None:
        if name is not None and name not in PARSERS:
            raise ValueError(f"unknown tool-call parser {name!r}: the transformers engine reads {', '.join(PARSERS)}")
        self.tool_call_parser = name
        self.info.tool_call_parser = name
        self.info.tool_calls = self._read_tool_calls

    def _tokens_changed(self) -> None:
        """A new tokenizer (a model loaded): grammars are compiled against it from now on."""
        self._compiler = None

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(self._tokenizer, int(self.info.vocab_size or 0), sorted(self._eos_ids))
        return self._compiler

    def _check_structured(self, request: GenerationRequest) -> None:
        """Refuse a grammar llguidance cannot build (or no llguidance), and ``auto`` tool calls
        without a parser, naming the field."""
        if request.tool_choice == "auto" and self.tool_call_parser is None:
            raise ValidationError("tool_choice", "this transformers worker reads no tool calls: start it with "
                                                 f"--tool-call-parser ({', '.join(PARSERS)})")
        field = structured_key(request)
        if field is None:
            return
        if importlib.util.find_spec("llguidance") is None:
            raise ValidationError(field, "the transformers engine constrains output with llguidance, which is not "
                                         "installed: pip install llguidance")
        self._grammar_compiler().check(request)

    def _attach_grammars(self, rows: list[_Row]) -> None:
        """Each structured row's grammar, advanced over what a continued request made before."""
        for row in rows:
            if structured_key(row.job.request) is None:
                continue
            grammar = self._grammar_compiler().grammar(row.job.request)
            if grammar is not None:
                grammar.advance_over(continued_output(row.job.request, row.job.prompt_ids))
            row.grammar = grammar

    def _allowed(self, rows: list[_Row]) -> "torch.Tensor | None":
        """``[rows, vocab]`` True where a row may draw the token next (None: no row has a grammar)."""
        if not any(row.grammar is not None for row in rows):
            return None
        import torch

        allowed = torch.ones((len(rows), int(self.info.vocab_size or 0)), dtype=torch.bool)
        for i, row in enumerate(rows):
            if row.grammar is not None and row.active:
                allowed[i] = row.grammar.allowed()
        return allowed

    def _read_tool_calls(self, request: GenerationRequest, sample: int, token_ids: list[int]) -> SampleToolCalls | None:
        family = PARSERS[self.tool_call_parser] if self.tool_call_parser else None
        return read_calls(request, sample, parser_text(self._tokenizer, token_ids, self._eos_ids), family)


__all__ = ["TransformersStructured"]
