"""The engine contract: everything an engine adapter implements or may declare, in one file.

A new engine is this file and :mod:`.example` (a complete engine in about 150 lines) to read:

* the :class:`Engine` protocol: ``info``, ``capabilities``, ``capacity``, ``start``, ``validate``,
  ``generate``, ``abort``, ``close``;
* what ``generate`` returns: an :class:`EngineOutput` of :class:`SampleOutput` (each ending with a
  :data:`FinishReason`);
* the optional capabilities, declared in :class:`EngineCapabilities` and promised by the
  protocols below it (streaming and checkpoints: :class:`PartialOutput`; text: :class:`Tokenizer`;
  weights and memory);
* the errors an engine raises and what the worker does with each (:class:`EngineError`);
* how the command line finds it: an :class:`EngineSpec` in :mod:`.registry` (its flags, whether it
  loads a model), or ``redroll worker --engine package.module:Class`` for an engine outside redroll.

Checking a declaration against an engine's members: :mod:`.declaration`. The checks engines share
(vocabulary, context window, extras they cannot make): :mod:`.checks`.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Protocol, Sequence, runtime_checkable

from redroll.shared.errors import RedrollError
from redroll.shared.types import GenerationRequest

FinishReason = Literal["stop", "length", "abort"]
"""Why a sample ended: a stop token or string (``stop``), ``max_new_tokens`` (``length``), or an
abort the worker asked for (``abort``). A sample that never started has None."""


@dataclass
class SampleOutput:
    """One sample of one request. Returned, it is the worker's: the record takes its lists as they
    are, so an engine gives lists it no longer changes (a fresh or a read-only one)."""

    token_ids: list[int]
    logprobs: list[float] | None
    """Per token, with ``return_logprob`` (else None): under the distribution ``info.logprob_mode`` names."""
    finish_reason: FinishReason | None
    weight_versions: list[str] | None = None
    """The weight version of each token, when they were not all made by one (an in-place update)."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per token, the request's ``top_logprobs_num`` most likely (token id, logprob) pairs."""
    routed_experts: Any = None
    """A :class:`redroll.shared.types.RoutedExperts` (``return_routed_experts``)."""
    text: str | None = None
    """The sample's decoded text, when the request wants text (:mod:`.text` says how it is cut)."""


@dataclass
class EngineOutput:
    samples: list[SampleOutput]
    prompt_tokens: int
    cached_tokens: int = 0
    weight_version: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    input_logprobs: list[float | None] | None = None
    """The prompt's logprobs from ``logprob_start_len`` on (the first prompt token has none)."""
    prompt_token_ids: list[int] | None = None
    """The prompt's token ids as the engine ran them (a text prompt tokenized, a chat rendered):
    what a record carries for ``return_prompt_token_ids``."""

    @property
    def aborted(self) -> bool:
        return any(s.finish_reason == "abort" for s in self.samples)


@dataclass
class EngineInfo:
    name: str
    model: str
    vocab_size: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    weight_version: str | None = None
    max_context: int | None = None
    logprob_mode: str = "temperature-scaled, before top-k/top-p"
    weight_ranks: int = 1
    """Ranks this engine takes in a trainer's weight-update group (SGLang: one per tensor-parallel GPU)."""
    tool_call_parser: str | None = None
    """The parser family the engine reads tool calls with (``--tool-call-parser``); None: none."""
    tool_calls: Callable[[GenerationRequest, int, list[int]], Any] | None = None
    """``tool_calls(request, sample index, its token ids)``: the sample's calls as the record
    carries them (a :class:`redroll.shared.types.SampleToolCalls`, or None), read by the engine's
    parser from its text. Called by the worker when it builds the record (after a resumed
    request's parts are joined), for requests with ``tools`` and a ``tool_choice`` other than
    ``none``. None: the engine reads no calls (texts stay texts; ``required`` and named choices
    are refused by its ``validate``)."""


# ---------------------------------------------------------------- errors


class EngineError(RedrollError):
    """The root of the errors an engine raises on purpose. What the worker does with each:

    ========================  =====================================================================
    raised from ``generate``  the worker
    ========================  =====================================================================
    ``ValidationError``       refuses the request: dead letter, ``error`` record naming the field
                              (:class:`redroll.shared.codec.ValidationError`: the request cannot be
                              served anywhere; better raised from ``validate``)
    :class:`EngineRequestError`  notes the error and hands the entry back: another attempt, on any
                              worker, until ``max_deliveries`` dead-letters it with this error
    :class:`EngineDeadError`  stops: claims nothing more, hands every entry it holds back to the
                              fleet at once and exits with status 1 (its supervisor restarts it)
    anything else             a defect in the adapter: as :class:`EngineRequestError`, logged with
                              its traceback
    ========================  =====================================================================
    """


class EngineRequestError(EngineError, RuntimeError):
    """The engine failed this request and still serves others (vLLM's ``EngineGenerateError``, an
    SGLang output that does not line up). ``status_code``: the HTTP status the engine attached, if any."""

    def __init__(self, message: str, *, status_code: int | None = None, rid: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.rid = rid


class EngineDeadError(EngineError, RuntimeError):
    """The engine cannot serve anything any more (vLLM's ``EngineDeadError``, a crashed scheduler
    process): the worker hands its entries back and exits."""


class EngineCommandRefused(EngineError, RuntimeError):
    """A weight or memory command the engine refuses, because it would crash or do nothing (the
    message says which and what to change)."""


class WeightUpdateError(EngineError, RuntimeError):
    """Loading new weights failed; the engine still serves the weights it had."""


class WeightsRefused(EngineError, ValueError):
    """Pushed tensors do not fit the model (unknown name, shape or dtype): nothing was staged."""


# ---------------------------------------------------------------- capabilities


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do beyond the :class:`Engine` protocol, declared by the engine (a class
    attribute ``capabilities``, or set in ``__init__`` when it depends on the engine's options).
    The worker asks this declaration, never the engine's methods; each true field promises the
    members of the protocol named beside it (:func:`.declaration.check_declaration` checks the promise)."""

    partial_output: bool = False
    """:class:`PartialOutput`: what a running request has made so far. Streamed requests need it
    (the worker refuses ``stream`` on an engine without it, naming the field), and so do the
    checkpoints that let another worker continue a request after this one dies."""
    tokenizer: bool = False
    """:class:`HasTokenizer`: a complete :class:`Tokenizer` (text prompts and chats continued after
    a checkpoint are rendered with it; streamed chunks' text is decoded with it)."""
    weights_from_disk: bool = False
    """:class:`DiskWeights`: load new weights from a checkpoint (the ``update_weights`` command)."""
    weights_in_place: bool = False
    """``update_weights_from_disk(..., in_place=True)`` swaps the weights under running requests
    (between two decode steps); without it an in-place update quiesces first."""
    weights_from_push: bool = False
    """:class:`PushedWeights`: take part in a trainer's broadcast (the ``sync_weights`` command)."""
    weights_from_tensor: bool = False
    """:class:`TensorWeights`: take tensors from a trainer in the same process (called by that
    trainer directly; the worker itself never calls it)."""
    memory_release: bool = False
    """:class:`MemoryRelease`: free engine memory for a colocated trainer and take it back (the
    ``release_memory`` / ``resume_memory`` commands; without it they only pause claiming)."""
    instant: bool = False
    """:class:`InstantGeneration`: an output without waiting (no model time); the worker then runs a
    claim's entries in one pass, without a task and a future per request."""
    progress_counters: bool = False
    """:class:`ProgressCounters`: counts its decoded tokens (``tokens_decoded`` in the heartbeat)."""
    grammar_resume: bool = False
    """A structured request (a grammar: ``json_schema``, ``regex``, ``ebnf``, a required or named
    ``tool_choice``) continued after saved tokens advances its grammar over them (the continuation
    is marked with :func:`.grammar.mark_continued`). Without it such a request is not continued:
    its worker starts it over (vLLM cannot start a grammar mid-completion)."""
    prefill_counters: bool = False
    """:class:`PrefillCounters`: counts its prefill, computed and served from a prefix cache
    (``prefill_tokens`` in the heartbeat, the ``redroll_worker_prefill_tokens`` metric)."""

    def names(self) -> list[str]:
        """The declared capabilities, by field name."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name)]


@runtime_checkable
class Engine(Protocol):
    """What the worker needs from an engine.

    ``capacity`` is how many requests the engine runs at once (its batch: vLLM's ``max_num_seqs``,
    SGLang's ``max_running_requests``), read by the worker after :meth:`start`; None declares an
    engine that runs whatever it is given at once (the synthetic one). The worker claims the
    capacity plus its prefetch (fair claiming: a worker never holds queued work it cannot start),
    and ``--max-inflight`` defaults to that.

    ``generate`` is called concurrently for up to that many requests; the engine batches them as
    it sees fit. ``abort(handle)`` stops one generation (queued inside the engine or running): its
    ``generate`` then returns what was produced so far with finish reason ``abort``. Unknown
    handles are ignored. Errors: see :class:`EngineError`.

    Anything more is declared in ``capabilities`` (:class:`EngineCapabilities`), never discovered.
    """

    info: EngineInfo
    capabilities: EngineCapabilities
    capacity: int | None

    async def start(self) -> None: ...

    def validate(self, request: GenerationRequest) -> None:
        """Raise :class:`redroll.shared.codec.ValidationError` for requests this engine cannot serve."""

    async def generate(self, request: GenerationRequest, handle: str) -> EngineOutput: ...

    def abort(self, handle: str) -> None: ...

    async def close(self) -> None: ...


# ---------------------------------------------------------------- the optional capabilities


class PartialOutput(Protocol):
    """``partial_output``: streaming and checkpoints. The worker calls :meth:`partial` every 20 ms
    at most for each streamed or checkpointed request and sends or saves what is new. A request
    the worker checkpoints reaches :meth:`Engine.generate` with ``stream`` or ``resumable`` set
    (the worker sets ``resumable`` on the requests its ``continuation`` setting saves): an engine
    that must arrange to show a request's output while it runs (vLLM's and SGLang's streamed
    deltas) does it for those."""

    def partial(self, handle: str) -> SampleOutput | None:
        """What the first sample of ``handle`` has made so far (lists the engine no longer
        changes; ``text`` too when the request wants text); None when it is not running or shows
        nothing yet."""


class Tokenizer(Protocol):
    """The text half of a model, as Hugging Face tokenizers have it."""

    chat_template: str | None
    """The chat template; None when the model has none (chats are then refused, naming ``messages``)."""

    def encode(self, text: str) -> list[int]:
        """A text prompt's token ids, as the engine feeds them to the model."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any:
        """Rendered with ``add_generation_prompt=True, tokenize=True`` (and ``tools``): the ids,
        or a mapping with ``input_ids``."""


class HasTokenizer(Protocol):
    """``tokenizer``."""

    tokenizer: Tokenizer | None
    """None while there is none (before :meth:`Engine.start`, or SGLang with ``skip_tokenizer_init``)."""


class DiskWeights(Protocol):
    """``weights_from_disk`` (and ``weights_in_place``)."""

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None, *,
                                       in_place: bool = False) -> str | None:
        """Load the weights at ``model_path`` and serve them as ``weight_version`` (the path when
        None). Without ``in_place`` the worker has quiesced first; with it (``weights_in_place``)
        the swap falls between two decode steps of the running requests. SGLang returns its message."""


class PushedWeights(Protocol):
    """``weights_from_push``: one attempt of a trainer's push (engine_worker/weight_sync.py)."""

    async def join_weight_group(self, *, address: str, port: int, rank_offset: int, world_size: int,
                                group_name: str, backend: str, timeout_s: float) -> None:
        """Join the trainer's weight-update group (ranks ``rank_offset`` .. + ``info.weight_ranks``)."""

    async def receive_weights(self, specs: Sequence[Any], *, group_name: str, version: str,
                              in_place: bool = True) -> None:
        """Receive the broadcast tensors (``specs``: name, dtype, shape each, in order)."""

    async def commit_weights(self, version: str) -> None:
        """Serve what was received as ``version`` (the trainer committed the push)."""

    async def discard_weights(self) -> bool:
        """Drop what was received; True when the engine still serves the weights it had before."""

    async def leave_weight_group(self) -> None:
        """Leave the group (nothing when not in one)."""


class TensorWeights(Protocol):
    """``weights_from_tensor``."""

    async def update_weights_from_tensor(self, named_tensors: Iterable[tuple[str, Any]], version: str) -> Any:
        """Take ``named_tensors`` (``model.named_parameters()`` of a trainer in this process) as ``version``."""


class MemoryRelease(Protocol):
    """``memory_release``."""

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free engine memory (every tag by default) until :meth:`resume_memory_occupation`."""

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Take back what was released (all of it by default)."""

    @property
    def released_tags(self) -> list[str]:
        """The memory tags released and not resumed yet."""


class InstantGeneration(Protocol):
    """``instant``."""

    def generate_now(self, request: GenerationRequest) -> EngineOutput:
        """The output at once: nothing waits, so no abort can arrive in between."""


class ProgressCounters(Protocol):
    """``progress_counters``."""

    tokens_decoded: int
    """Output tokens the engine made so far."""


class PrefillCounters(Protocol):
    """``prefill_counters``."""

    prefill_tokens_computed: int
    """Prompt tokens fed to the model by prefill."""
    prefill_tokens_cached: int
    """Prompt tokens whose KV came from a prefix cache instead."""


CAPABILITY_PROTOCOLS: dict[str, type] = {
    "partial_output": PartialOutput,
    "tokenizer": HasTokenizer,
    "weights_from_disk": DiskWeights,
    "weights_from_push": PushedWeights,
    "weights_from_tensor": TensorWeights,
    "memory_release": MemoryRelease,
    "instant": InstantGeneration,
    "progress_counters": ProgressCounters,
    "prefill_counters": PrefillCounters,
}
"""Each capability field → the protocol its engine promises (``weights_in_place`` is a promise
about :class:`DiskWeights`' method, checked there)."""


# ---------------------------------------------------------------- how the command line finds an engine


@dataclass(frozen=True)
class EngineOption:
    """One ``redroll worker`` flag an engine honours, and the keyword of its constructor it sets.

    Several engines may honour one flag (``--context-length`` is vLLM's ``max_model_len`` and
    SGLang's ``context_length``): each names its own keyword. A flag given to an engine that does
    not list it is refused, naming both."""

    flag: str
    """``--context-length``; its ``REDROLL_*`` variable is derived (``REDROLL_CONTEXT_LENGTH``) unless ``env``."""
    kwarg: str
    """The engine constructor's keyword this flag sets."""
    help: str
    type: Callable[[str], Any] | None = str
    """The value's parser; None for an on/off flag (``store_true``)."""
    default: Any = None
    """This engine's value when the flag and its variable are absent (None: the constructor's default)."""
    aliases: tuple[str, ...] = ()
    """Other spellings (an engine's own name for a generic setting: ``--mem-fraction-static``)."""
    negates: bool = False
    """An on/off flag whose presence sets the keyword to False (``--no-prefix-caching``)."""
    repeatable: bool = False
    """``KEY=VALUE`` pairs, repeatable, collected into one dict (``--vllm-arg``)."""
    choices: tuple[str, ...] | None = None
    env: str | None = None
    hidden: bool = False
    """Left out of ``--help`` (fault injection for tests)."""

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def env_name(self) -> str:
        return self.env or "REDROLL_" + self.dest.upper()


@dataclass(frozen=True)
class EngineSpec:
    """An engine as the command line, ``worker_refusal`` and the docs' engine table see it."""

    name: str
    factory: str
    """``package.module:Class``, imported only when a worker starts this engine (an engine's
    libraries — torch, vllm, sglang — stay out of every other import)."""
    summary: str
    """One line: what it runs, where (the docs' table and ``redroll worker --help``)."""
    loads_model: bool
    """Needs ``--model-path`` (no default: a worker names the model it serves)."""
    options: tuple[EngineOption, ...] = ()
    accepts_hub_ids: bool = False
    """``--model-path`` may be a Hugging Face Hub id, ``ORG/NAME`` (the engine downloads it)."""
    builtin_models: tuple[str, ...] = ()
    """``--model-path`` values that are not directories (the transformers engine's ``tiny-random``)."""
    from_settings: tuple[tuple[str, str], ...] = ()
    """Constructor keywords taken from the worker's settings: (keyword, :class:`~redroll.shared.settings.Settings` field)."""

    def option(self, flag: str) -> EngineOption | None:
        return next((o for o in self.options if o.flag == flag or flag in o.aliases), None)

    def engine_class(self) -> type:
        module, _, attr = self.factory.partition(":")
        return getattr(importlib.import_module(module), attr)

    def create(self, **kwargs: Any) -> Engine:
        return self.engine_class()(**kwargs)
