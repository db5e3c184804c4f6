"""Structured output for the engines that decode themselves (the transformers engine): a grammar
per sample, with llguidance.

Why llguidance: it is one abi3 wheel with no dependencies (vLLM's own CPU build pins it), it
takes SGLang's three request keys as they are — a JSON schema (``json_schema``), a regular
expression (``regex``) and an EBNF grammar (``ebnf``: llguidance converts GBNF to its Lark
dialect) — and it computes the allowed tokens of a step from a Hugging Face tokenizer in
microseconds on the CPU. xgrammar needs triton for its CPU masking path in the builds we run, and
outlines brings a model-wrapping framework we do not need.

A sample's :class:`Grammar` masks the logits of each step (the tokens the grammar forbids get
``-inf`` before sampling, after ``min_new_tokens``' bans) and consumes the token drawn. When the
grammar is complete, only the end-of-sequence tokens remain allowed, so a sample that fits its
budget ends with ``stop``. The logprob the record carries is the model's, not the masked one:
``log_softmax(logits / T)`` before the mask (as before top-k / top-p), so a trainer's
teacher-forced forward pass recomputes it without the grammar.

**Continuing a structured request.** A grammar can be advanced over tokens made before
(:meth:`Grammar.advance_over`): a request continued after a checkpoint on another worker
(``engine_worker/checkpoints.py``) runs its grammar over the saved output first, then generates
under the state it reached (:func:`continued_output`). llguidance refuses tokens its grammar does
not accept: such a continuation is refused by the engine rather than run unconstrained.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from redroll.engine_worker.engines.tool_calls import tool_choice_schema
from redroll.shared.codec import ValidationError
from redroll.shared.types import GenerationRequest

STRUCTURED_KEYS = ("json_schema", "regex", "ebnf")
"""The sampling keys a grammar comes from (SGLang's names)."""


def structured_key(request: GenerationRequest) -> str | None:
    """The field a request's grammar comes from (``sampling_params.json_schema``, ... or
    ``tool_choice`` for a required or named choice); None for a request without one."""
    sp = request.sampling_params
    keys = [k for k in STRUCTURED_KEYS if getattr(sp, k) is not None]
    if tool_choice_schema(request) is not None:
        if keys:
            raise ValidationError("tool_choice", f"a required or named tool choice constrains the output itself: not "
                                                 f"with sampling_params.{keys[0]}")
        return "tool_choice"
    if len(keys) > 1:
        raise ValidationError(f"sampling_params.{keys[1]}", f"one grammar per request: not with {keys[0]}")
    return f"sampling_params.{keys[0]}" if keys else None


def is_structured(request: GenerationRequest) -> bool:
    """Whether the request's output is constrained by a grammar (what a continuation must know)."""
    return structured_key(request) is not None


def llguidance_grammar(request: GenerationRequest) -> tuple[str, str] | None:
    """(field, llguidance grammar text) of a structured request; None for one without a grammar.
    A schema that is not JSON is refused naming its field."""
    import llguidance

    field = structured_key(request)
    if field is None:
        return None
    sp = request.sampling_params
    if field == "tool_choice":  # (compact JSON, as vLLM's guidance backend writes it by default)
        return field, llguidance.LLMatcher.grammar_from_json_schema(tool_choice_schema(request),
                                                                    defaults={"whitespace_flexible": False})
    if sp.json_schema is not None:
        try:
            schema = json.loads(sp.json_schema)
        except ValueError as exc:
            raise ValidationError(field, f"not JSON: {exc}") from None
        return field, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    if sp.regex is not None:
        return field, llguidance.LLMatcher.grammar_from_regex(sp.regex)
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return field, llguidance.LLMatcher.grammar_from_lark(any_to_lark(sp.ebnf or ""))
    except Exception as exc:  # (the converter raises on what it cannot read)
        raise ValidationError(field, f"not a grammar llguidance reads: {exc}") from None


class ByteTokens:
    """A byte tokenizer (ids 0-255 are bytes, then specials) as llguidance's ``TokenizerWrapper`` reads one."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        specials = {int(t) for t in getattr(tokenizer, "all_special_ids", ())}
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.special_token_ids = sorted(specials)
        self.tokens = [bytes([i]) if i < 256 else f"<special_{i}>".encode() for i in range(vocab_size)]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


class GrammarCompiler:
    """One engine's llguidance tokenizer (built once: about a second for a large vocabulary) and
    the matchers of its requests."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]):
        import llguidance

        eos = sorted(set(eos_ids)) or None
        if hasattr(tokenizer, "backend_tokenizer"):
            import llguidance.hf

            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        else:
            wrapper = llguidance.TokenizerWrapper(ByteTokens(tokenizer, vocab_size))
            self.tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size

    def check(self, request: GenerationRequest) -> None:
        """Refuse a grammar llguidance cannot build, naming its field."""
        self.grammar(request)

    def grammar(self, request: GenerationRequest) -> "Grammar | None":
        import llguidance

        found = llguidance_grammar(request)
        if found is None:
            return None
        field, text = found
        error = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        if error:
            raise ValidationError(field, f"llguidance cannot build this grammar: {_one_line(error)}")
        return Grammar(llguidance.LLMatcher(self.tokenizer, text, log_level=0), self.vocab_size, field)


class Grammar:
    """One sample's grammar state: the tokens it allows next, advanced by each token drawn."""

    def __init__(self, matcher: Any, vocab_size: int, field: str):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.field = field

    def allowed(self) -> Any:
        """A bool tensor ``[vocab]``: True where the grammar allows the token next."""
        import numpy as np
        import torch

        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint32)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:self.vocab_size]
        return torch.from_numpy(bits.astype(bool))

    def advance(self, token: int) -> None:
        """Consume the token drawn (an end-of-sequence token ends the grammar)."""
        if not self.matcher.is_stopped():
            self.matcher.consume_token(int(token))

    def advance_over(self, tokens: Sequence[int]) -> None:
        """Consume tokens made before (a continuation's saved output); a token the grammar refuses
        is a :class:`ValidationError` naming the grammar's field."""
        if tokens and not self.matcher.consume_tokens([int(t) for t in tokens]):
            raise ValidationError(self.field, f"the saved output does not follow the grammar: "
                                              f"{_one_line(self.matcher.get_error())}")

    @property
    def failed(self) -> bool:
        return bool(self.matcher.is_error())


def continued_output(request: GenerationRequest, prompt_ids: Sequence[int]) -> list[int]:
    """The output a continued structured request made before (the tail of its prompt that is its
    own output: ``meta_info["resumed_tokens"]`` of them, set by the worker that continues it), which
    its grammar is advanced over; empty for a request that is not a continuation."""
    made = int((request.meta_info or {}).get(RESUMED_TOKENS_KEY) or 0)
    return list(prompt_ids[len(prompt_ids) - made:]) if 0 < made <= len(prompt_ids) else []


RESUMED_TOKENS_KEY = "resumed_tokens"
"""The ``meta_info`` key a continuation of a structured request carries: how many of its prompt's
last tokens are its own output made before (:func:`mark_continued`)."""


def mark_continued(continued: GenerationRequest, original: GenerationRequest, made: int) -> GenerationRequest:
    """``continued`` (``original`` continued: its prompt as token ids + ``made`` saved tokens) told
    that its last ``made`` prompt tokens are its output, so that an engine with
    ``EngineCapabilities.grammar_resume`` advances its grammar over them; a tool choice's grammar
    keeps the original's ``tools``. For the code that builds continuations (checkpoints)."""
    import msgspec

    if not is_structured(original) or made <= 0:
        return continued
    return msgspec.structs.replace(continued, tools=original.tools, tool_choice=original.tool_choice,
                                   meta_info={**continued.meta_info, RESUMED_TOKENS_KEY: made})


def _one_line(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= 300 else text[:297] + "..."


__all__ = ["Grammar", "GrammarCompiler", "RESUMED_TOKENS_KEY", "STRUCTURED_KEYS", "continued_output",
           "is_structured", "llguidance_grammar", "mark_continued", "structured_key"]
