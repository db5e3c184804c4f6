"""Text in and out, for every engine: chat requests rendered with the model's own chat template,
and each sample's text for the record.

* :func:`render_chat` turns a request's ``messages`` (and ``tools``) into prompt token ids with
  the tokenizer's ``apply_chat_template(..., add_generation_prompt=True, tokenize=True)`` (the
  request's ``chat_template`` instead of the model's, and its ``chat_template_kwargs`` as template
  variables, when it has them). A
  tokenizer without a chat template (the built-in tiny model's byte tokenizer), or none at all,
  refuses the request with a :class:`ValidationError` naming ``messages``, as does a template
  that raises (roles out of order, a tool the template cannot place).
* :func:`sample_text` is a sample's text as the record carries it: its token ids decoded, cut
  just before the stop string that ended it (the stop string is not part of the text, as with
  SGLang, vLLM and OpenAI's API; ``no_stop_trim`` keeps it and cuts after it, as vLLM's
  ``include_stop_str_in_output`` and SGLang do). The token ids stay whole: up to and including the
  token that completed the stop string.
* :func:`add_text` fills the samples an engine returned without text (engines that detokenize
  themselves, vLLM and SGLang, give theirs).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Sequence

import msgspec

from redroll.engine_worker.engines.base import EngineOutput
from redroll.shared.codec import ValidationError
from redroll.shared.types import GenerationRequest, SamplingParams


def chat_messages(request: GenerationRequest) -> list[dict[str, Any]]:
    """The request's messages as the plain maps chat templates read (unset keys left out)."""
    return [msgspec.to_builtins(m) for m in request.messages or ()]


def has_chat_template(tokenizer: Any) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None)) \
        and callable(getattr(tokenizer, "apply_chat_template", None))


def render_chat(tokenizer: Any, request: GenerationRequest, engine: str) -> list[int]:
    """The prompt token ids of a chat request, rendered by ``tokenizer``'s chat template."""
    if not has_chat_template(tokenizer) and not (request.chat_template and tokenizer is not None
                                                  and callable(getattr(tokenizer, "apply_chat_template", None))):
        raise ValidationError("messages", f"the {engine} engine's tokenizer has no chat template: "
                                          "send prompt or input_ids")
    kwargs: dict[str, Any] = {**(request.chat_template_kwargs or {}), "add_generation_prompt": True, "tokenize": True}
    if request.tools is not None:
        kwargs["tools"] = request.tools
    if request.chat_template is not None:  # (rendered in transformers' Jinja sandbox, as the model's own)
        kwargs["chat_template"] = request.chat_template
    try:
        rendered = tokenizer.apply_chat_template(chat_messages(request), **kwargs)
    except Exception as exc:  # (jinja2's TemplateError, a ValueError from the tokenizer, ...)
        raise ValidationError("messages", f"the chat template refused them: {_one_line(exc)}") from None
    if isinstance(rendered, Mapping) or hasattr(rendered, "input_ids"):  # (transformers 5: a BatchEncoding)
        rendered = rendered["input_ids"]
    ids = [int(t) for t in rendered]
    if not ids:
        raise ValidationError("messages", "the chat template rendered no tokens")
    return ids


TURN_MARK = "\u2063redroll-turn\u2063"
"""The content of the stand-in assistant turn a continuation is rendered after (a text no template
changes and no tokenizer merges with what the template puts around it)."""


def encode_plain(tokenizer: Any, text: str) -> list[int]:
    """``text``'s ids without the special tokens a tokenizer adds to a whole prompt (a BOS)."""
    try:
        return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    except TypeError:  # (a tokenizer without that keyword adds none)
        return [int(t) for t in tokenizer.encode(text)]


def render_continuation(tokenizer: Any, request: GenerationRequest, engine: str) -> list[int]:
    """A session's next prompt: ``prefix_ids`` (the conversation so far: the last turn's prompt and
    completion) + the new part alone, never the history re-rendered.

    The new part of a chat is what the template renders after an assistant turn: the template is
    rendered for a stand-in conversation (a user turn, an assistant turn whose content is
    :data:`TURN_MARK`) with and without the new ``messages``; the new messages' rendering is the
    difference (the template must render them as a suffix, or the request is refused naming
    ``messages``). The end of the assistant turn the model did not write comes first: the template's
    closing after the content (``<|im_end|>\n``, ``<|eot_id|>``) minus what the completion already
    ends with (its end-of-turn token when it stopped on it; nothing when it was cut by
    ``max_tokens``, so a truncated turn is closed as the template closes one). A text ``prompt``
    is encoded and appended (no BOS)."""
    prefix = list(request.prefix_ids or ())
    if request.messages is None:
        return prefix + encode_plain(tokenizer, request.prompt or "")
    if not has_chat_template(tokenizer) and not request.chat_template:
        raise ValidationError("messages", f"the {engine} engine's tokenizer has no chat template: send prompt or "
                                          "input_ids")
    kwargs: dict[str, Any] = {**(request.chat_template_kwargs or {}), "tokenize": False}
    if request.tools is not None:
        kwargs["tools"] = request.tools
    if request.chat_template is not None:
        kwargs["chat_template"] = request.chat_template
    stand_in = [{"role": "user", "content": "."}, {"role": "assistant", "content": TURN_MARK}]
    try:
        before = tokenizer.apply_chat_template(stand_in, add_generation_prompt=False, **kwargs)
        after = tokenizer.apply_chat_template(stand_in + chat_messages(request), add_generation_prompt=True, **kwargs)
    except Exception as exc:
        raise ValidationError("messages", f"the chat template refused them: {_one_line(exc)}") from None
    if not isinstance(before, str) or not after.startswith(before) or TURN_MARK not in before:
        raise ValidationError("messages", "the chat template does not render new messages as a suffix of the "
                                          "conversation: send the whole conversation without prefix_ids")
    closing = encode_plain(tokenizer, before[before.rindex(TURN_MARK) + len(TURN_MARK):])
    written = next((k for k in range(min(len(closing), len(prefix)), 0, -1) if prefix[-k:] == closing[:k]), 0)
    return prefix + closing[written:] + encode_plain(tokenizer, after[len(before):])


def prompt_token_ids(tokenizer: Any, request: GenerationRequest, engine: str) -> list[int] | None:
    """The prompt's ids as an engine with ``tokenizer`` runs them: ``input_ids``; a session's
    continuation (``prefix_ids``); a chat rendered by its template; a text encoded."""
    if request.input_ids is not None:
        return list(request.input_ids)
    if tokenizer is None:
        return None
    if request.prefix_ids is not None:
        return render_continuation(tokenizer, request, engine)
    if request.messages is not None:
        return render_chat(tokenizer, request, engine)
    return [int(t) for t in tokenizer.encode(request.prompt or "")]


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def find_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """Where the earliest stop string in ``text`` starts, and which (the first listed of those
    starting there); None when there is none."""
    found = [(i, n, stop) for n, stop in enumerate(stops) if (i := text.find(stop)) >= 0]
    if not found:
        return None
    at, _, stop = min(found)
    return at, stop


def trim_stop(text: str, params: SamplingParams, finish_reason: str | None) -> str:
    """``text`` cut before the stop string that ended its sample (after it with ``no_stop_trim``).
    A text an engine cut so already is left as it is."""
    if finish_reason == "stop" and params.stop:
        hit = find_stop(text, params.stop)
        if hit is not None:
            at, stop = hit
            return text[:at + len(stop)] if params.no_stop_trim else text[:at]
    return text


def sample_text(tokenizer: Any, token_ids: Sequence[int], params: SamplingParams, finish_reason: str | None) -> str:
    """One sample's text: its ids decoded (``skip_special_tokens`` as the request says), cut before
    the stop string that ended it unless ``no_stop_trim``."""
    text = tokenizer.decode(list(token_ids), skip_special_tokens=params.skip_special_tokens)
    return trim_stop(text, params, finish_reason)


def add_text(output: EngineOutput, request: GenerationRequest, tokenizer: Any) -> EngineOutput:
    """Give every sample of ``output`` without text its text, when the request wants text."""
    if not request.wants_text or tokenizer is None:
        return output
    for sample in output.samples:
        if sample.text is None:
            sample.text = sample_text(tokenizer, sample.token_ids, request.sampling_params, sample.finish_reason)
    return output


__all__ = ["TURN_MARK", "add_text", "chat_messages", "encode_plain", "find_stop", "has_chat_template",
           "prompt_token_ids", "render_chat", "render_continuation", "sample_text", "trim_stop"]
