"""The small protocol every engine adapter implements, and the optional capabilities it declares."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

from redroll.shared.codec import ValidationError
from redroll.shared.types import GenerationRequest


@dataclass
class SampleOutput:
    """One sample of one request. Returned, it is the worker's: the record takes its lists as they
    are, so an engine gives lists it no longer changes (a fresh or a read-only one)."""

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None
    """"stop", "length", "abort", or None when it never started."""
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


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do beyond the :class:`Engine` protocol, declared by the engine (a class
    attribute ``capabilities``, or set in ``__init__`` when it depends on the engine's options).
    The worker asks this declaration, never the engine's methods; each true field promises the
    members of the protocol named beside it (:func:`check_declaration` checks the promise)."""

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
    partial_output: bool = False
    """:class:`PartialOutput`: what a running request has made so far (checkpoints of resumable requests)."""
    instant: bool = False
    """:class:`InstantGeneration`: an output without waiting (no model time); the worker then runs a
    claim's entries in one pass, without a task and a future per request."""
    progress_counters: bool = False
    """:class:`ProgressCounters`: counts its decoded tokens (``tokens_decoded`` in the heartbeat)."""
    prefill_counters: bool = False
    """:class:`PrefillCounters`: counts its prefill, computed and served from a prefix cache
    (``prefill_tokens`` in the heartbeat, the ``redroll_worker_prefill_tokens`` metric)."""
    tokenizer: bool = False
    """:class:`HasTokenizer`: a ``tokenizer`` attribute that decodes ids to text (the demo prints
    text); it may still be None (not started, or SGLang with ``skip_tokenizer_init``)."""

    def names(self) -> list[str]:
        """The declared capabilities, by field name."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name)]


NO_CAPABILITIES = EngineCapabilities()
"""What an engine that declares nothing can do beyond :class:`Engine`: nothing."""


def capabilities_of(engine: Any) -> EngineCapabilities:
    """An engine's declaration; :data:`NO_CAPABILITIES` for an engine object that has none (a
    stand-in written before declarations). The worker reads it once, when it is built."""
    declared = getattr(engine, "capabilities", NO_CAPABILITIES)
    if not isinstance(declared, EngineCapabilities):
        raise TypeError(f"{type(engine).__name__}.capabilities is a {type(declared).__name__}, "
                        "not an EngineCapabilities")
    return declared


@runtime_checkable
class Engine(Protocol):
    """What the worker needs from an engine: a new engine is one file to read (this one).

    ``generate`` is called concurrently for up to ``max_inflight`` requests; the engine batches
    them as it sees fit. ``abort(handle)`` stops one generation (queued inside the engine or
    running): its ``generate`` then returns what was produced so far with finish reason "abort".
    Unknown handles are ignored.

    Anything more is optional and declared, not discovered: ``capabilities`` is an
    :class:`EngineCapabilities` whose true fields promise the members of the protocols below, and
    the worker calls only what is declared (an engine object without ``capabilities`` has none):

    * ``weights_from_disk`` (:class:`DiskWeights`), ``weights_in_place`` (that method honours
      ``in_place=True``): the ``update_weights`` command;
    * ``weights_from_push`` (:class:`PushedWeights`): a trainer's broadcast, ``sync_weights``;
    * ``weights_from_tensor`` (:class:`TensorWeights`): a trainer in the same process;
    * ``memory_release`` (:class:`MemoryRelease`): ``release_memory`` / ``resume_memory``;
    * ``partial_output`` (:class:`PartialOutput`): checkpoints of resumable requests;
    * ``instant`` (:class:`InstantGeneration`): an engine that makes an output without waiting (no
      model time: the synthetic engine without per-token time) has a synchronous
      ``generate_now(request) -> EngineOutput``; the worker then runs the entries of a claim in one
      pass, without a task and a future per request;
    * ``progress_counters`` (:class:`ProgressCounters`), ``prefill_counters``
      (:class:`PrefillCounters`): counters the heartbeat and the metrics report;
    * ``tokenizer`` (:class:`HasTokenizer`): ids decoded to text (the demo).

    An engine declares them as a class attribute, ``capabilities = EngineCapabilities(
    weights_from_disk=True, partial_output=True)``, or in ``__init__`` where they depend on its
    options (the synthetic engine's ``instant``).

    A declared capability the engine cannot serve in its present configuration (SGLang's memory
    release without the memory saver) stays declared; its method refuses with a message that says
    what to change. ``check_declaration(engine)`` lists where a declaration and the engine's
    members disagree: every engine's tests assert it is empty.
    """

    info: EngineInfo
    capabilities: EngineCapabilities

    async def start(self) -> None: ...

    def validate(self, request: GenerationRequest) -> None:
        """Raise :class:`redroll.shared.codec.ValidationError` for requests this engine cannot serve."""

    async def generate(self, request: GenerationRequest, handle: str) -> EngineOutput: ...

    def abort(self, handle: str) -> None: ...

    async def close(self) -> None: ...


# ---------------------------------------------------------------- the optional capabilities


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


class PartialOutput(Protocol):
    """``partial_output``."""

    def partial(self, handle: str) -> SampleOutput | None:
        """What the first sample of ``handle`` has made so far (lists the engine no longer
        changes); None when it is not running or shows nothing yet."""


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


class HasTokenizer(Protocol):
    """``tokenizer``."""

    tokenizer: Any
    """Has ``decode(ids, skip_special_tokens=True) -> str``; None while there is none."""


CAPABILITY_PROTOCOLS: dict[str, type] = {
    "weights_from_disk": DiskWeights,
    "weights_from_push": PushedWeights,
    "weights_from_tensor": TensorWeights,
    "memory_release": MemoryRelease,
    "partial_output": PartialOutput,
    "instant": InstantGeneration,
    "progress_counters": ProgressCounters,
    "prefill_counters": PrefillCounters,
    "tokenizer": HasTokenizer,
}
"""Each capability field → the protocol its engine promises (``weights_in_place`` is a promise
about :class:`DiskWeights`' method, checked there)."""


def _members(protocol: type) -> dict[str, Any]:
    """A protocol's own members: name → its function (a method), its property, or None (an attribute)."""
    out: dict[str, Any] = {name: None for name in vars(protocol).get("__annotations__", {})}
    for name, value in vars(protocol).items():
        if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property)):
            out[name] = value
    return out


def _signature_mismatch(wanted: Any, method: Any, optional: frozenset[str] = frozenset()) -> str | None:
    """Why ``method`` cannot be called as the protocol's ``wanted`` is called (None: it can);
    ``optional``: parameters the worker passes only when another capability is declared."""
    if inspect.iscoroutinefunction(wanted) != inspect.iscoroutinefunction(method):
        return "must be async" if inspect.iscoroutinefunction(wanted) else "must not be async"
    try:
        have = inspect.signature(method).parameters
    except (TypeError, ValueError):  # (a builtin without a signature: taken on trust)
        return None
    want = [p for p in inspect.signature(wanted).parameters.values() if p.name != "self"]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in have.values())
    missing = [p.name for p in want if p.name not in have and p.name not in optional and not takes_any]
    if missing:
        return f"has no parameter {', '.join(missing)}"
    wanted_names = {p.name for p in want}
    extra = [name for name, p in have.items() if name not in wanted_names and p.default is inspect.Parameter.empty
             and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if extra:
        return f"requires parameter {', '.join(extra)} the worker does not pass"
    return None


def _accepts(method: Any, parameter: str) -> bool:
    try:
        parameters = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
    return parameter in parameters


def check_declaration(engine: Any, *, undeclared: bool = True) -> list[str]:
    """Where ``engine``'s declaration and its members disagree (empty when they agree):

    * a declared capability with a member missing, or not callable as the worker calls it (a sync
      method for an async one, a parameter missing, a required parameter the worker does not pass);
    * ``weights_in_place`` without ``weights_from_disk``, or without an ``in_place`` parameter;
    * with ``undeclared``: a capability whose members are all there but which is not declared (an
      engine that declares less than it has on purpose, as the synthetic engine's ``instant``
      with per-token time, is checked with ``undeclared=False``).
    """
    declared = capabilities_of(engine)
    name = type(engine).__name__
    problems: list[str] = []
    for capability, protocol in CAPABILITY_PROTOCOLS.items():
        on = getattr(declared, capability)
        optional = frozenset() if declared.weights_in_place else frozenset({"in_place"})
        members = _members(protocol)
        missing: list[str] = []
        unfit: list[str] = []
        for member, wanted in members.items():
            if wanted is None or isinstance(wanted, property):
                if not hasattr(engine, member):
                    missing.append(member)
                continue
            method = getattr(engine, member, None)
            if not callable(method):
                missing.append(member)
                continue
            why = _signature_mismatch(wanted, method, optional if capability == "weights_from_disk" else frozenset())
            if why is not None:
                unfit.append(f"{name} declares {capability}: its {member} {why}")
        if on:
            problems.extend(unfit)
            if missing:
                problems.append(f"{name} declares {capability} but has no {', '.join(missing)}")
        elif undeclared and not missing and not unfit:
            problems.append(f"{name} has {', '.join(members)} but does not declare {capability}")
    update = getattr(engine, "update_weights_from_disk", None)
    if declared.weights_in_place and not declared.weights_from_disk:
        problems.append(f"{name} declares weights_in_place without weights_from_disk")
    elif (undeclared and declared.weights_from_disk and not declared.weights_in_place and update is not None
          and _accepts(update, "in_place")):
        problems.append(f"{name}'s update_weights_from_disk takes in_place but it does not declare weights_in_place")
    return problems


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
