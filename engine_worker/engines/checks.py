"""Checks every engine's ``validate`` shares: token ids inside the vocabulary and the context
window, and the per-request extras an engine cannot make, each refused naming the field."""

from __future__ import annotations

from typing import Any

from redroll.shared.codec import ValidationError
from redroll.shared.types import GenerationRequest


def refuse_extras(request: GenerationRequest, engine: str, *, top_logprobs: bool = False,
                  prompt_logprobs: bool = False, routed_experts: bool = False) -> None:
    """Refuse the per-request extras this engine cannot produce (the flags: what it can)."""
    if request.top_logprobs_num and not top_logprobs:
        raise ValidationError("top_logprobs_num", f"the {engine} engine does not return top logprobs")
    if request.logprob_start_len is not None and not prompt_logprobs:
        raise ValidationError("logprob_start_len", f"the {engine} engine does not return prompt logprobs")
    if request.return_routed_experts and not routed_experts:
        raise ValidationError("return_routed_experts",
                              f"the {engine} engine has no MoE routing to return (SGLang with "
                              "enable_return_routed_experts has)")


def refuse_tool_choice(request: GenerationRequest, engine: str) -> None:
    """Refuse a tool choice this engine cannot honour (it reads no calls and builds no call grammar)."""
    if request.tools is not None and request.tool_choice not in (None, "none"):
        raise ValidationError("tool_choice", f"the {engine} engine reads no tool calls yet: send tool_choice none "
                                             "(or none at all: the text comes back as text)")


def refuse_text(request: GenerationRequest, engine: str, tokenizer: Any) -> None:
    """Refuse a chat request or one that asks for text when this engine has no tokenizer."""
    if tokenizer is not None:
        return
    if request.messages is not None:
        raise ValidationError("messages", f"the {engine} engine has no tokenizer to render a chat: send input_ids")
    if request.return_text:
        raise ValidationError("return_text", f"the {engine} engine has no tokenizer to decode text")


def check_token_ids(request: GenerationRequest, vocab_size: int | None, max_context: int | None) -> None:
    """Common engine-side checks: ids inside the vocabulary and the context window."""
    if vocab_size is not None:
        for field_name, ids in (("input_ids", request.input_ids or []),
                                ("sampling_params.stop_token_ids", request.sampling_params.stop_token_ids)):
            if not ids or max(ids) < vocab_size:
                continue  # the common case, checked in C
            for i, t in enumerate(ids):
                if t >= vocab_size:
                    raise ValidationError(f"{field_name}[{i}]", f"token id {t} is outside the vocabulary of {vocab_size}")
    if request.input_ids is not None:
        check_context(request, len(request.input_ids), max_context)


def check_context(request: GenerationRequest, prompt_tokens: int, max_context: int | None) -> None:
    """The prompt (``prompt_tokens`` long: token ids, or the text as this engine tokenizes it) and
    ``max_new_tokens`` fit the context window. Over it, the prompt field is named when the prompt
    alone fills the window, else ``sampling_params.max_new_tokens``, with the numbers either way."""
    if max_context is None:
        return
    max_new = request.sampling_params.max_new_tokens
    if prompt_tokens >= max_context:
        raise ValidationError("input_ids" if request.input_ids is not None
                              else "messages" if getattr(request, "messages", None) is not None else "prompt",
                              f"the prompt ({prompt_tokens} tokens) leaves no room in the model context of "
                              f"{max_context}")
    if prompt_tokens + max_new > max_context:
        raise ValidationError("sampling_params.max_new_tokens",
                              f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new}) exceeds the model "
                              f"context of {max_context}: at most {max_context - prompt_tokens} new tokens fit")
