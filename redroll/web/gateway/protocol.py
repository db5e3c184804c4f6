"""The OpenAI-compatible request bodies the gateway accepts (msgspec Structs) and its error shape.

Field names follow OpenAI's API; the RL extensions are named as vLLM's OpenAI server names them
(``return_token_ids``, ``return_tokens_as_token_ids``, ``priority``, ``session_id``, ``top_k``,
``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``,
``skip_special_tokens``, ``prompt_logprobs``, ``structured_outputs``, ``cache_salt``,
``chat_template``, ``chat_template_kwargs``), plus redroll's own ``min_weight_version``. Every
field is honoured or refused in one line naming it: an unknown field is refused (the Structs
forbid unknown fields), and so is a value redroll cannot honour (``echo``, ``suffix``, ``best_of``
other than ``n``, ``parallel_tool_calls`` false, ``stream_options`` without ``stream``,
``prompt_logprobs`` above 0, ...).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Optional, Union

import msgspec
from msgspec import Meta

from redroll.shared.errors import RedrollError

TokenIds = list[Annotated[int, Meta(ge=0)]]
Stop = Union[str, list[str], None]


class GatewayError(RedrollError):
    """An HTTP error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def invalid(param: str, rule: str) -> GatewayError:
    """A 400 naming ``param`` in its one-line message."""
    return GatewayError(400, f"invalid {param}: {rule}", param=param, code="invalid_value")


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's ``stream_options``."""

    include_usage: bool = False
    """A last chunk with ``choices: []`` and the call's ``usage`` (the others carry ``usage: null``)."""


class StructuredOutputs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs``: handed to the workers as SGLang's keys (``regex``, ``json_schema``,
    ``ebnf``, ``structural_tag``); a worker whose engine cannot constrain its output refuses it
    naming the field (400)."""

    regex: Optional[str] = None
    json: Any = None
    """A JSON schema (an object, or its text)."""
    grammar: Optional[str] = None
    """An EBNF grammar."""
    structural_tag: Optional[str] = None


class _Sampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What both endpoints share."""

    model: Optional[str] = None
    n: Annotated[int, Meta(ge=1, le=128)] = 1
    temperature: Optional[Annotated[float, Meta(ge=0.0, le=2.0)]] = None
    top_p: Optional[Annotated[float, Meta(gt=0.0, le=1.0)]] = None
    stop: Stop = None
    seed: Optional[Annotated[int, Meta(ge=0, le=2**63 - 1)]] = None
    frequency_penalty: Optional[Annotated[float, Meta(ge=-2.0, le=2.0)]] = None
    presence_penalty: Optional[Annotated[float, Meta(ge=-2.0, le=2.0)]] = None
    user: Optional[str] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    # vLLM's extensions
    top_k: Optional[int] = None
    min_p: Optional[Annotated[float, Meta(ge=0.0, le=1.0)]] = None
    repetition_penalty: Optional[Annotated[float, Meta(gt=0.0, le=2.0)]] = None
    stop_token_ids: Optional[TokenIds] = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    skip_special_tokens: bool = True
    priority: int = 0
    """vLLM's: lower runs earlier, 0 by default. Below 0 is redroll's high priority (1), else normal (0)."""
    return_token_ids: Optional[bool] = None
    """Each choice carries ``token_ids``, and the prompt's ids (``prompt_token_ids``: as sent, or as
    the worker tokenized or rendered the prompt)."""
    return_tokens_as_token_ids: Optional[bool] = None
    """Tokens in logprobs are ``token_id:<id>``: always so here (the gateway holds no tokenizer), so
    only true (or null) is taken."""
    prompt_logprobs: Optional[int] = None
    """0: each prompt token's own logprob (``prompt_logprobs``, vLLM's shape); above 0 is refused."""
    structured_outputs: Optional[StructuredOutputs] = None
    cache_salt: Optional[Annotated[str, Meta(min_length=1, max_length=1024)]] = None
    """Taken for what trainers salt with (a policy version): redroll never serves a prompt's cached
    prefix across weight versions. The salt itself isolates nothing further."""
    session_id: Optional[Annotated[str, Meta(min_length=1, max_length=4096)]] = None
    # redroll's
    min_weight_version: Optional[Annotated[int, Meta(ge=0)]] = None


class CompletionBody(_Sampling, kw_only=True):
    """``POST /v1/completions``: ``prompt`` is text, a list of texts, token ids or a list of them."""

    prompt: Union[str, list[Any]]
    """Checked by :func:`redroll.web.gateway.translate.build_requests` (msgspec takes one list type in a union)."""
    max_tokens: Optional[Annotated[int, Meta(ge=0)]] = 16
    logprobs: Optional[Annotated[int, Meta(ge=0, le=20)]] = None
    echo: Optional[bool] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class ChatBody(_Sampling, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]]
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Any = None
    """``none``, ``auto`` (the default with tools), ``required`` or ``{"type": "function",
    "function": {"name": ...}}``: handed to the workers (``required`` and a named function
    constrain the output with the engine's structured output)."""
    parallel_tool_calls: Optional[bool] = None
    """False: one call per choice at most (a ``required`` choice's schema holds one, as vLLM's)."""
    max_tokens: Optional[Annotated[int, Meta(ge=0)]] = None
    max_completion_tokens: Optional[Annotated[int, Meta(ge=0)]] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[Annotated[int, Meta(ge=0, le=20)]] = None
    response_format: Optional[dict[str, Any]] = None
    chat_template: Optional[str] = None
    """A Jinja template to render ``messages`` with instead of the model's own (only with
    ``redroll serve --trust-request-chat-template``, as vLLM's ``--trust-request-chat-template``)."""
    chat_template_kwargs: Optional[dict[str, Any]] = None
    """Extra template variables (``{"enable_thinking": false}``), passed to ``apply_chat_template``."""
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]] = None
    """As vLLM takes it: the template variables ``reasoning_effort`` and (unless the call sets it)
    ``enable_thinking`` (false for ``none``)."""


_PATH = re.compile(r"at `\$\.?([^`]*)`")
_UNKNOWN = re.compile(r"^Object contains unknown field `([^`]*)`")

UNKNOWN_HINTS = {
    "extra_body": "extra_body is the openai SDK's argument, not a body field: send its fields at the top level "
                  "of the body (the SDK merges them so)",
}
"""What a refusal of an unknown field adds, for fields clients are known to send by mistake."""


def unknown_field(param: str) -> GatewayError:
    """A 400 for a body field this gateway neither honours nor knows."""
    name = param.rpartition(".")[2]
    why = UNKNOWN_HINTS.get(param) or UNKNOWN_HINTS.get(name) or "unknown field: this gateway does not honour it"
    return GatewayError(400, f"invalid {param}: {why}", param=param, code="unknown_field")


def decode_body(raw: bytes, kind: type[msgspec.Struct]) -> Any:
    """``raw`` JSON as ``kind``; a body that breaks a rule is a 400 naming the field (a field the
    gateway does not know included)."""
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        found = _PATH.search(text)
        param = found.group(1) if found else None
        unknown = _UNKNOWN.match(text)
        if unknown:
            raise unknown_field(f"{param}.{unknown.group(1)}" if param else unknown.group(1)) from None
        rule = _PATH.sub("", text).strip(" -")
        if param is None and "missing required field" in text:
            param = text.rsplit("`", 2)[-2] if text.count("`") >= 2 else None
        raise GatewayError(400, f"invalid {param or 'body'}: {rule}", param=param, code="invalid_value") from None
    except msgspec.DecodeError as exc:
        raise GatewayError(400, f"invalid body: not JSON ({exc})", param=None, code="invalid_json") from None


def response_format_schema(body: ChatBody) -> str | None:
    """The JSON schema (its text) a chat's ``response_format`` asks for: ``json_object`` is any
    object, ``json_schema`` its ``json_schema.schema`` (every schema is enforced: ``strict`` true or
    not); None for ``text``. Anything else is refused naming the field."""
    fmt = body.response_format
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text" and set(fmt) == {"type"}:
        return None
    if kind == "json_object" and set(fmt) == {"type"}:
        return '{"type": "object"}'
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if set(fmt) != {"type", "json_schema"} or not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise invalid("response_format.json_schema", "must be {\"name\": ..., \"schema\": {...}, \"strict\": ...}")
        unknown = set(spec) - {"name", "schema", "strict", "description"}
        if unknown:
            raise invalid(f"response_format.json_schema.{sorted(unknown)[0]}", "unknown field")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise invalid("response_format.json_schema.schema", "must be a JSON schema (an object)")
        return msgspec.json.encode(schema).decode()
    raise invalid("response_format", f"type {kind!r} is not one of text, json_object, json_schema")


def _check_tool_choice(body: ChatBody) -> None:
    choice = body.tool_choice
    if choice is None:
        return
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise invalid("tool_choice", f"{choice!r} is not one of none, auto, required or a named function")
    elif not (isinstance(choice, dict) and choice.get("type") == "function"
              and isinstance(choice.get("function"), dict) and isinstance(choice["function"].get("name"), str)):
        raise invalid("tool_choice", "a named choice is {\"type\": \"function\", \"function\": {\"name\": NAME}}")
    if not body.tools and choice != "none":
        raise invalid("tool_choice", "needs tools")
    if body.response_format is not None and (choice == "required" or isinstance(choice, dict)):
        if response_format_schema(body) is not None:
            raise invalid("response_format", "not with a required or named tool_choice (it constrains the output "
                                             "itself)")


def refuse_unsupported(body: CompletionBody | ChatBody, *, trust_chat_template: bool = False) -> None:
    """The values this gateway cannot honour, each refused naming its field."""
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options", "only allowed with stream=true")
    if isinstance(body, CompletionBody):
        if body.echo:
            raise invalid("echo", "echo is not supported")
        if body.suffix:
            raise invalid("suffix", "suffix is not supported")
        if body.best_of is not None and body.best_of != body.n:
            raise invalid("best_of", "best_of must equal n (every sample is returned)")
    else:
        response_format_schema(body)
        _check_tool_choice(body)
        if body.chat_template is not None and not trust_chat_template:
            raise invalid("chat_template", "a request's chat template is code the worker runs: this gateway takes one "
                                           "only when started with --trust-request-chat-template")
    if body.top_k is not None and body.top_k < -1:
        raise invalid("top_k", "must be -1, 0 (both off) or >= 1")
    if body.return_tokens_as_token_ids is False:
        raise invalid("return_tokens_as_token_ids", "only true: the gateway holds no tokenizer, so tokens are "
                                                    "always spelled token_id:<id>")
    if body.prompt_logprobs is not None:
        if body.prompt_logprobs != 0:
            raise invalid("prompt_logprobs", "only 0 (each prompt token's own logprob): redroll's engines return no "
                                             "top-k for prompt positions")
        if body.stream:
            raise invalid("prompt_logprobs", "not with stream=true")
