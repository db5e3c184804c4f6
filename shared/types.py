"""The wire contract, declared once: what a producer asks for and what a worker answers.

Each message is a msgspec ``Struct`` whose annotations are its schema: decoding MessagePack into
it validates types and ``Meta`` constraints in C, with the path of a failure (``$.input_ids[3]``).
The wire format is plain MessagePack maps (docs/design.md, "Wire format"); what a static schema cannot
say — limits from settings, cross-field rules, the newer-``v`` hand-back — is checked in
:mod:`.codec`, small and explicit.
"""

import enum
from typing import Annotated, Any, Literal, Optional, Union

import msgspec
from msgspec import Meta

SCHEMA_VERSION = 5
"""The newest schema version this code reads and writes. A request is written with the lowest
version that carries every field it uses (:func:`request_schema_version`)."""

FIRST_SCHEMA_VERSION = 1
"""The version of every request (and record) that uses no field added later: workers of any
release run it."""

TEXT_SCHEMA_VERSION = 2
"""The version that added chat ``messages``, ``tools`` and ``return_text`` (requests) and
``output_text`` (records)."""


STREAM_SCHEMA_VERSION = 3
"""The version that added ``stream`` (requests)."""

PROMPT_SCHEMA_VERSION = 4
"""The version that added ``return_prompt_token_ids``, ``chat_template`` and
``chat_template_kwargs`` (requests); records carry ``prompt_token_ids`` (an optional field: any
record reader skips it)."""

AGENT_SCHEMA_VERSION = 5
"""The version that added ``tool_choice`` and ``prefix_ids`` (requests); records carry
``tool_calls`` (an optional field: any record reader skips it)."""

TOOL_CHOICES = ("none", "auto", "required")
"""``tool_choice``'s words; a named function is ``{"type": "function", "function": {"name": ...}}``."""

MAX_CHAT_TEMPLATE_CHARS = 65_536
"""The longest ``chat_template`` a request may carry."""

RESERVED_CHAT_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
"""``apply_chat_template``'s own parameters: the worker sets them, a request's
``chat_template_kwargs`` may not (they are template variables only)."""


class RecordStatus(str, enum.Enum):
    FINISHED = "finished"
    ABORTED = "aborted"
    EXPIRED = "expired"
    ERROR = "error"


FINISH_REASONS = ("stop", "length", "abort")

# ---------------------------------------------------------------- constrained scalars

REQUEST_ID_PATTERN = r"^[!-z|~]{1,128}\Z"
"""1–128 printable ASCII characters, no whitespace, no braces (``\\Z``, not ``$``: ``$`` also
matches before a final newline)."""

REQUEST_ID_RULE = "must be 1-128 printable ASCII characters, without whitespace or braces"
""":data:`REQUEST_ID_PATTERN` in words, as a refusal says it."""

SCHEMA_VERSION_RULE = "schema version must be a positive integer"
"""How a refusal names the schema version field ``v``, whether missing, of the wrong type or out of range."""

RequestId = Annotated[str, Meta(pattern=REQUEST_ID_PATTERN)]
TraceParent = Annotated[str, Meta(pattern=r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}", max_length=512)]
"""A W3C trace context ``traceparent`` (``<version>-<trace id>-<parent span id>-<flags>``)."""
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
UnixSeconds = Annotated[float, Meta(ge=-1e15, le=1e15)]
"""A finite number of seconds (NaN and the infinities fail the bounds)."""
NonEmptyStr = Annotated[str, Meta(min_length=1)]
FinishReason = Optional[Literal["stop", "length", "abort"]]


# ---------------------------------------------------------------- sampling parameters


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """Sampling parameters with SGLang's names and defaults (an unknown key is refused).

    Bounds that come from settings (``max_new_tokens``, ``n``) and cross-field rules are checked
    by :func:`redroll.shared.codec.check_sampling_params`."""

    max_new_tokens: Annotated[int, Meta(ge=0)] = 128
    temperature: Annotated[float, Meta(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1, le=2**31 - 1)] = -1
    """-1 (disabled) or a positive integer."""
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    stop: Union[NonEmptyStr, Annotated[tuple[NonEmptyStr, ...], Meta(max_length=64)]] = ()
    """Stop strings (a single string decodes as a one-element tuple)."""
    stop_token_ids: Annotated[tuple[TokenId, ...], Meta(max_length=1024)] = ()
    n: Annotated[int, Meta(ge=1)] = 1
    ignore_eos: bool = False
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] = 1.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    min_new_tokens: Annotated[int, Meta(ge=0)] = 0
    sampling_seed: Optional[Annotated[int, Meta(ge=0, le=2**63 - 1)]] = None
    skip_special_tokens: bool = True
    # SGLang keys forwarded as they are (the transformers engine refuses the ones it lacks).
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    structural_tag: Optional[str] = None
    stop_regex: Union[str, list[str], None] = None
    no_stop_trim: Optional[bool] = None
    spaces_between_special_tokens: Optional[bool] = None
    logit_bias: Optional[dict[str, Any]] = None
    custom_params: Optional[dict[str, Any]] = None
    stream_interval: Optional[int] = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            msgspec.structs.force_setattr(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            msgspec.structs.force_setattr(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            msgspec.structs.force_setattr(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def extra(self) -> dict[str, Any]:
        """The passthrough keys that are set."""
        return {name: getattr(self, name) for name in PASSTHROUGH_SAMPLING_KEYS if getattr(self, name) is not None}

    def to_wire(self) -> dict[str, Any]:
        """Only the values that differ from the defaults, as plain msgpack-able types."""
        return msgspec.to_builtins(self)

    def engine_kwargs(self, *, include_n: bool = False) -> dict[str, Any]:
        """Keyword arguments for an SGLang-style ``sampling_params`` dict."""
        out = self.to_wire()
        out["max_new_tokens"] = self.max_new_tokens
        if not include_n:
            out.pop("n", None)
        return out


PASSTHROUGH_SAMPLING_KEYS = ("json_schema", "regex", "ebnf", "structural_tag", "stop_regex", "no_stop_trim",
                             "spaces_between_special_tokens", "logit_bias", "custom_params", "stream_interval")
"""SGLang sampling keys forwarded untouched (after their type check)."""


# ---------------------------------------------------------------- requests

class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """One turn of a chat request, as chat templates read it (OpenAI's message shape, text only)."""

    role: Annotated[str, Meta(min_length=1, max_length=64)]
    """``system``, ``user``, ``assistant``, ``tool`` or any role the model's template knows."""
    content: Optional[str] = None
    """The text (nil for an assistant turn that only calls tools)."""
    name: Optional[Annotated[str, Meta(max_length=256)]] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    """An assistant turn's tool calls (``{"type": "function", "function": {"name", "arguments"}}``)."""
    tool_call_id: Optional[Annotated[str, Meta(max_length=256)]] = None
    """A ``tool`` turn: the call it answers."""


MAX_CHAT_MESSAGES = 4096
"""The most turns one chat request may carry."""

MAX_TOP_LOGPROBS = 20
"""The most ``top_logprobs_num`` a request may ask for (each is a pair per output token)."""


class GenerationRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One generation request as it travels on ``{ns}:requests`` (the ``data`` map).

    ``v`` 0 and ``submitted_at`` None stand for "now" until the request is encoded; on the wire
    both are required."""

    request_id: RequestId
    input_ids: Optional[Annotated[list[TokenId], Meta(min_length=1)]] = None
    prompt: Optional[NonEmptyStr] = None
    messages: Optional[Annotated[list[ChatMessage], Meta(min_length=1, max_length=MAX_CHAT_MESSAGES)]] = None
    """A chat (schema 2): rendered by the worker with the model's own chat template (its
    tokenizer's ``apply_chat_template`` with ``add_generation_prompt``). Exactly one of
    ``input_ids``, ``prompt`` and ``messages``."""
    tools: Optional[Annotated[list[dict[str, Any]], Meta(min_length=1, max_length=1024)]] = None
    """With ``messages`` (schema 2): tool definitions handed to the chat template."""
    return_text: Optional[bool] = None
    """Records carry each sample's decoded text (``output_text``; schema 2). Nil: on for
    ``prompt`` and ``messages`` requests, off for ``input_ids``."""
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    return_logprob: bool = False
    collect_unfinished: bool = False
    meta_info: dict[str, Any] = {}
    reply_to: Optional[Annotated[str, Meta(max_length=512)]] = None
    callback: Optional[Annotated[str, Meta(max_length=256)]] = None
    group_id: Optional[RequestId] = None
    affinity_key: Optional[RequestId] = None
    """Requests with one key run on one worker when affinity lanes are on (a session id for the
    turns of a conversation; group members default to their ``group_id``)."""
    deadline: Optional[UnixSeconds] = None
    submitted_at: Optional[UnixSeconds] = None
    lora_path: Optional[Annotated[str, Meta(max_length=4096)]] = None
    model: Optional[Annotated[str, Meta(max_length=4096)]] = None
    priority: Literal[0, 1] = 0
    """0 = normal; 1 = high (queued on ``{ns}:requests:high``, claimed before normal requests)."""
    min_weight_version: Optional[Annotated[int, Meta(ge=0)]] = None
    """Only workers whose (integer) weight_version is at least this may generate it."""
    requeued: Annotated[int, Meta(ge=0)] = 0
    """How often ``redroll dead requeue`` gave this request another attempt (its record says so,
    and consumer groups de-duplicate each attempt on its own)."""
    top_logprobs_num: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] = 0
    """With ``return_logprob``: the k most likely tokens at each output position, with their
    logprobs (record ``output_top_logprobs``)."""
    logprob_start_len: Optional[Annotated[int, Meta(ge=0)]] = None
    """With ``return_logprob``: the prompt tokens' logprobs from this prompt position on (record
    ``input_logprobs``); nil: none."""
    return_routed_experts: bool = False
    """MoE routing replay: the experts each token was routed to (record ``routed_experts``; SGLang
    started with ``enable_return_routed_experts``; sized by the worker's ``max_routed_experts_bytes``)."""
    resumable: bool = False
    """Save partial output while generating (``{ns}:partial:<request_id>``) so that a worker that
    takes the entry after a death or a drain continues from there instead of starting over.
    Single-sample, ``input_ids`` prompts; saved only from ``checkpoint_min_new_tokens`` on."""
    stream: bool = False
    """Send the output while it is generated (schema 3): chunks on its producer's chunk stream
    ``{tag}:chunks:<producer>`` every ``stream_chunk_tokens`` tokens or
    ``stream_chunk_ms`` ms, each saved as a checkpoint in the same write, so a worker that takes
    the entry after a death continues after what was sent. Single-sample (n = 1), with a reply stream."""
    traceparent: Optional[TraceParent] = None
    """The W3C trace context of the submit (OpenTelemetry, optional): every worker that runs the
    request traces under it."""
    return_prompt_token_ids: bool = False
    """The record carries ``prompt_token_ids``: the prompt's token ids as the engine ran them (a
    text prompt tokenized, a chat rendered by its template; schema 4)."""
    chat_template: Optional[Annotated[str, Meta(min_length=1, max_length=MAX_CHAT_TEMPLATE_CHARS)]] = None
    """With ``messages`` (schema 4): the Jinja chat template to render them with, instead of the
    model's own (``apply_chat_template(..., chat_template=...)``, in transformers' sandbox)."""
    chat_template_kwargs: Optional[Annotated[dict[str, Any], Meta(max_length=64)]] = None
    """With ``messages`` (schema 4): extra template variables (``enable_thinking``, ...), passed to
    ``apply_chat_template`` as keyword arguments; its own parameters are refused."""
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    """With ``tools`` (schema 5), as OpenAI's: ``auto`` (nil: the default) lets the model call tools
    and the worker parse its calls (record ``tool_calls``); ``none`` leaves the output as text;
    ``required`` and a named function (``{"type": "function", "function": {"name": ...}}``)
    constrain the output to calls with the engine's structured output (an engine without one
    refuses them, naming the field)."""
    parallel_tool_calls: Optional[bool] = None
    """With ``tools`` (schema 5): false allows one call per sample (a ``required`` choice's schema
    holds one item, as vLLM's); nil or true: any number."""
    prefix_ids: Optional[Annotated[list[TokenId], Meta(min_length=1)]] = None
    """With ``messages`` or ``prompt`` (schema 5): the conversation so far as token ids (a previous
    turn's prompt + completion). The prompt is these ids + the new part alone, rendered by the
    worker (the chat template's rendering of ``messages`` as a continuation, or ``prompt``
    encoded): never the history re-rendered (docs/agents.md, "Sessions")."""
    v: Annotated[int, Meta(ge=0)] = 0

    @property
    def n(self) -> int:
        return self.sampling_params.n

    @property
    def wants_text(self) -> bool:
        """Whether the record carries ``output_text``: ``return_text``, or by default for a text
        or chat prompt."""
        return self.return_text if self.return_text is not None else self.input_ids is None

    @property
    def lane_key(self) -> Optional[str]:
        """What places this request on an affinity lane: its ``affinity_key``, else its ``group_id``."""
        return self.affinity_key or self.group_id


def request_schema_version(request: GenerationRequest) -> int:
    """The lowest schema version that carries every field ``request`` uses: a worker that knows
    only an older one would silently drop such a field, so it hands the entry back instead."""
    if request.tool_choice is not None or request.prefix_ids is not None or request.parallel_tool_calls is not None:
        return AGENT_SCHEMA_VERSION
    if request.return_prompt_token_ids or request.chat_template is not None \
            or request.chat_template_kwargs is not None:
        return PROMPT_SCHEMA_VERSION
    if request.stream:
        return STREAM_SCHEMA_VERSION
    if request.messages is not None or request.tools is not None or request.return_text is not None:
        return TEXT_SCHEMA_VERSION
    return FIRST_SCHEMA_VERSION


# ---------------------------------------------------------------- records


class RoutedExperts(msgspec.Struct, kw_only=True):
    """The experts every token was routed to: little-endian int32 ``[tokens, layers, top_k]``
    (SGLang's ``meta_info["routed_experts"]``, decoded from base64)."""

    shape: tuple[Annotated[int, Meta(ge=0)], Annotated[int, Meta(ge=0)], Annotated[int, Meta(ge=0)]]
    data: bytes

    def to_list(self) -> list[list[list[int]]]:
        import array

        flat = array.array("i")
        flat.frombytes(self.data)
        tokens, layers, top_k = self.shape
        return [[list(flat[(t * layers + layer) * top_k:(t * layers + layer + 1) * top_k]) for layer in range(layers)]
                for t in range(tokens)]


TopLogprob = tuple[TokenId, float]


class ToolCall(msgspec.Struct, kw_only=True):
    """One tool call a sample made, parsed by the worker (OpenAI's ``tool_calls[i]``)."""

    id: str
    """``call_<24 hex digits>``, derived from the request_id, the sample and the call's index (the
    same on every attempt and every gateway replica)."""
    name: str
    arguments: str
    """The arguments as a JSON object's text."""


class SampleToolCalls(msgspec.Struct, kw_only=True):
    """A sample's output read as a tool-calling assistant turn."""

    calls: list[ToolCall] = []
    content: Optional[str] = None
    """The text outside the calls (nil when there is none)."""


class RecordData(msgspec.Struct, kw_only=True):
    """The ``data`` map of a result entry (``status`` and ``worker`` are plain stream fields)."""

    request_id: RequestId
    output_token_ids: list[list[TokenId]] = []
    finish_reasons: list[FinishReason] = []
    output_logprobs: Optional[list[list[float]]] = None
    meta_info: dict[str, Any] = {}
    error: Optional[str] = None
    callback: Optional[Annotated[str, Meta(max_length=256)]] = None
    group_id: Optional[Annotated[str, Meta(max_length=256)]] = None
    requeued: Annotated[int, Meta(ge=0)] = 0
    weight_versions: Optional[list[Optional[list[str]]]] = None
    """Per sample, the weight version of each output token (same length as its ids), when a sample
    spans a weight update (an in-place update, a resumed or partial rollout); nil for a sample one
    version made (``meta_info.weight_version``)."""
    output_top_logprobs: Optional[list[list[list[TopLogprob]]]] = None
    """Per sample, per output token: the request's ``top_logprobs_num`` most likely (token id,
    logprob) pairs, most likely first."""
    input_logprobs: Optional[list[Optional[float]]] = None
    """The prompt tokens' logprobs from the request's ``logprob_start_len`` on (nil for the first
    prompt token, which has none)."""
    routed_experts: Optional[list[Optional[RoutedExperts]]] = None
    """Per sample, the experts each of its tokens was routed to (``return_routed_experts``)."""
    output_text: Optional[list[str]] = None
    """Per sample, its decoded text when the request wants it (schema 2; see docs/design.md,
    "Text in and out")."""
    prompt_token_ids: Optional[list[TokenId]] = None
    """The prompt's token ids as the engine ran them, when the request asked
    (``return_prompt_token_ids``)."""
    tool_calls: Optional[list[Optional[SampleToolCalls]]] = None
    """Per sample, its tool calls as the worker's parser read them from its text (a request with
    ``tools`` and a ``tool_choice`` other than ``none``; nil for a sample that called none)."""
    traceparent: Optional[TraceParent] = None
    """The W3C trace context of the worker's publish (OpenTelemetry, optional): consumer groups'
    callbacks trace under it."""
    v: Annotated[int, Meta(ge=1)] = FIRST_SCHEMA_VERSION


RECORD_DATA_FIELDS = msgspec.structs.fields(RecordData)


class CompletionRecord(RecordData, kw_only=True):
    """One result record: its data map plus the entry's plain ``status`` and ``worker``."""

    status: RecordStatus
    worker: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.status is RecordStatus.FINISHED

    def token_versions(self, sample: int = 0) -> list[str | None]:
        """The weight version of each output token of ``sample``."""
        spans = self.weight_versions[sample] if self.weight_versions else None
        if spans is not None:
            return list(spans)
        return [self.meta_info.get("weight_version")] * len(self.output_token_ids[sample])

    @property
    def dedup_id(self) -> str:
        """What consumer groups de-duplicate on: the request_id, per requeue attempt."""
        return self.request_id if not self.requeued else f"{self.request_id}#requeue{self.requeued}"

    def data(self) -> RecordData:
        """The wire part (every field but ``status`` and ``worker``)."""
        return RecordData(**{f.name: getattr(self, f.name) for f in RECORD_DATA_FIELDS})

    @classmethod
    def failed(
        cls,
        request: GenerationRequest | None,
        *,
        request_id: str,
        status: RecordStatus,
        error: str | None,
        worker: str | None,
        n: int = 1,
        meta_info: dict[str, Any] | None = None,
    ) -> "CompletionRecord":
        """A record with no output (ROLL's ``finish_reasons == [None]`` convention)."""
        meta = dict(request.meta_info) if request is not None else {}
        meta.update(meta_info or {})
        return cls(
            request_id=request_id,
            status=status,
            output_token_ids=[[] for _ in range(n)],
            finish_reasons=[None] * n,
            output_logprobs=None,
            meta_info=meta,
            error=error,
            worker=worker,
            callback=request.callback if request is not None else None,
            group_id=request.group_id if request is not None else None,
            requeued=request.requeued if request is not None else 0,
        )
