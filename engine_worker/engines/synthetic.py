"""A model-free engine: deterministic tokens at a fixed per-token time.

For measuring the queue itself and for fault tests. Tokens are derived from the request's
input and ``sampling_seed`` (or its request_id when no seed is given), so a replay produces
the same output.

Text: token id ``t`` reads as the word ``SYNTHETIC_WORDS[t % 16]`` after a space, so a sample's
text (``output_text``) is its ids spelled that way, and stop strings (``sampling_params.stop``)
end a sample at the token that completes one, as a model's detokenizer would. A chat request
(``messages``) needs no template here: its messages, encoded, are the input its tokens derive from.

Fault injection (for reliability tests and the chaos harness, off by default): a request whose
prompt contains ``raise_marker`` makes ``generate`` raise; one containing ``exit_marker`` kills
the whole worker process (``os._exit``), as a poison request that crashes an engine would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import random
import time
from array import array
from typing import Any

import msgspec

from redroll.engine_worker.engines.base import EngineCapabilities, EngineInfo, EngineOutput, SampleOutput
from redroll.engine_worker.engines.checks import check_context, check_token_ids, refuse_extras
from redroll.engine_worker.engines.synthetic_script import ScriptBytes, load_script, reply_for, scripted_ids
from redroll.engine_worker.engines.text import find_stop, sample_text
from redroll.engine_worker.engines.tool_calls import PARSERS, parser_text, read_calls
from redroll.shared.codec import ValidationError
from redroll.shared.types import GenerationRequest, SamplingParams

SYNTHETIC_WORDS = ("the", "queue", "worker", "token", "record", "stream", "reply", "group",
                   "claim", "batch", "model", "weight", "prompt", "sample", "redis", "done")
"""What the synthetic engine's token ids read as (``t % 16``, each after a space)."""


_SPACED = tuple(" " + word for word in SYNTHETIC_WORDS)


class SyntheticWords:
    """The synthetic engine's tokenizer: ``decode([1, 18])`` is ``" queue worker"``; a text prompt
    encodes as its UTF-8 bytes (one token each, as its context check counts them), and a chat as
    the bytes of its messages (no template: its tokens derive from them as they are)."""

    chat_template = "(the messages' own bytes)"

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join([_SPACED[t & 15] for t in ids])  # (ids are never negative: t & 15 is t % 16)

    def apply_chat_template(self, conversation: list[dict], tools: list | None = None, **_: object) -> list[int]:
        return list(msgspec.msgpack.encode([conversation, tools]))


_WORDS = SyntheticWords()


class SyntheticEngine:
    capabilities = EngineCapabilities(weights_from_disk=True, weights_in_place=True, partial_output=True,
                                      progress_counters=True, tokenizer=True)
    tokenizer = _WORDS
    """Decodes ids as the records' text spells them (streamed chunks' text)."""
    # (plus ``instant`` when it makes outputs without waiting: no ``token_ms``, no ``slots``; set in ``__init__``)

    def __init__(self, *, token_ms: float = 0.0, vocab_size: int = 32000, weight_version: str = "0",
                 model: str = "synthetic", max_context: int | None = None, jitter: float = 0.0,
                 raise_marker: str | None = None, exit_marker: str | None = None, slots: int | None = None,
                 script: str | None = None, tool_call_parser: str | None = None, declare_instant: bool = True):
        self.token_ms = float(token_ms)
        self.slots = slots
        """Continuous-batching capacity: at most this many requests generate at once (None: no limit)."""
        self.capacity = slots
        """The engine contract's capacity: ``slots`` (None: it runs whatever it is given at once)."""
        self._slots = asyncio.Semaphore(slots) if slots else None
        self.jitter = float(jitter)
        """Per-request token time varies by ±jitter (a fraction), derived from the request_id."""
        self.raise_marker = raise_marker
        self.exit_marker = exit_marker
        self.info = EngineInfo(name="synthetic", model=model, vocab_size=vocab_size, eos_token_id=None,
                               pad_token_id=None, weight_version=weight_version, max_context=max_context)
        self._abort_events: dict[str, asyncio.Event] = {}
        self.tokens_decoded = 0
        """Output tokens this engine made (what it returned; an aborted generation counts its part)."""
        self._running: dict[str, tuple[GenerationRequest, float, float]] = {}
        """handle → (request, start, ms per token) of generations under way (for :meth:`partial`)."""
        self._partial_samples: dict[str, tuple[list[int], list[float], str]] = {}
        """The first sample of each running generation, once :meth:`partial` made it."""
        self._version_changes: list[tuple[float, str]] = []
        self._script = load_script(script) if script is not None else None
        """Scripted replies (``--script``): the engine then speaks bytes (:mod:`.synthetic_script`)."""
        if self._script is not None:
            self.tokenizer = ScriptBytes()  # type: ignore[assignment]
        if tool_call_parser is not None and tool_call_parser not in PARSERS:
            raise ValueError(f"unknown tool-call parser {tool_call_parser!r}: the synthetic engine reads "
                             f"{', '.join(PARSERS)}")
        self.tool_call_parser = tool_call_parser
        self.info.tool_call_parser = tool_call_parser
        self.info.tool_calls = self._read_tool_calls
        if self.instant and declare_instant:  # (False: the worker's general path, for benchmarks/worker_drain.py)
            self.capabilities = dataclasses.replace(type(self).capabilities, instant=True)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        for ev in self._abort_events.values():
            ev.set()

    def validate(self, request: GenerationRequest) -> None:
        check_token_ids(request, self.info.vocab_size, self.info.max_context)
        if request.input_ids is None:  # (a text prompt is one token per byte here)
            check_context(request, len((request.prompt or "").encode()), self.info.max_context)
        refuse_extras(request, "synthetic")
        _refuse_structured(request)
        if request.tool_choice == "auto" and self.tool_call_parser is None:
            raise ValidationError("tool_choice", "this synthetic worker reads no tool calls: start it with "
                                                 f"--tool-call-parser ({', '.join(PARSERS)})")

    def _read_tool_calls(self, request: GenerationRequest, sample: int, token_ids: list[int]) -> Any:
        family = PARSERS[self.tool_call_parser] if self.tool_call_parser else None
        return read_calls(request, sample, parser_text(self.tokenizer, token_ids, set()), family)

    def _reply(self, request: GenerationRequest) -> bytes | None:
        return reply_for(self._script, request) if self._script is not None else None

    def abort(self, handle: str) -> None:
        ev = self._abort_events.get(handle)
        if ev is not None:
            ev.set()

    def tokens_for(self, request: GenerationRequest, sample: int,
                   with_logprobs: bool = True) -> tuple[list[int], list[float]]:
        """The full (unaborted) output of one sample: ids and logprobs (empty without
        ``with_logprobs``; the ids are the same either way)."""
        return self._tokens(_hash_source(request), sample, request.sampling_params.max_new_tokens, with_logprobs)

    def _sample(self, source: bytes, sample: int, sp: SamplingParams, with_logprobs: bool,
                reply: bytes | None = None) -> tuple[list[int], list[float], str]:
        """One sample as it ends: its tokens up to and with the first stop token or the token that
        completes a stop string ("stop"), else all ``max_new_tokens`` of them ("length"); a
        scripted ``reply``: its bytes."""
        if reply is not None:
            ids, reason = scripted_ids(reply, sp.max_new_tokens)
            return ids, self._tokens(source, sample, len(ids), with_logprobs)[1], reason
        ids, lps = self._tokens(source, sample, sp.max_new_tokens, with_logprobs)
        if sp.stop_token_ids or sp.stop:
            text = ""
            for j, t in enumerate(ids):
                if t in sp.stop_token_ids:
                    return ids[: j + 1], lps[: j + 1], "stop"
                if sp.stop:
                    text += _WORDS.decode([t])
                    if find_stop(text, sp.stop) is not None:
                        return ids[: j + 1], lps[: j + 1], "stop"
        return ids, lps, "length"

    def _tokens(self, source: bytes, sample: int, n: int, with_logprobs: bool) -> tuple[list[int], list[float]]:
        # An extendable-output hash of (input, seed, sample) gives 32 bits per token and per
        # logprob in one C call, whatever the length (the first n words are the ids, the next n
        # the logprobs: a shorter digest is its prefix).
        words = array("I", hashlib.shake_256(b"%s|%d" % (source, sample)).digest((8 if with_logprobs else 4) * n))
        vocab = self.info.vocab_size or 32000
        ids = [x % vocab for x in words[:n]]
        logprobs = [x * (-4.0 / 4294967296.0) for x in words[n:]] if with_logprobs else []
        return ids, logprobs

    def _token_ms(self, request: GenerationRequest) -> float:
        if not self.jitter:
            return self.token_ms
        u = random.Random(request.request_id).random()
        return self.token_ms * max(0.0, 1.0 + self.jitter * (2.0 * u - 1.0))

    def _inject_faults(self, request: GenerationRequest) -> None:
        text = request.prompt or "".join(m.content or "" for m in request.messages or ())
        if self.exit_marker and self.exit_marker in text:
            os._exit(86)
        if self.raise_marker and self.raise_marker in text:
            raise RuntimeError(f"synthetic engine failure for {request.request_id}")

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None, *,
                                       in_place: bool = False) -> None:
        """No weights to load: only the version changes (records carry it). ``in_place``: requests
        generating now switch at this moment (their tokens after it carry the new version)."""
        version = weight_version if weight_version is not None else model_path
        self._version_changes.append((time.monotonic(), version))
        del self._version_changes[:-64]
        self.info.weight_version = version

    def _versions_of(self, started: float, token_s: float, count: int, first: str) -> list[str] | None:
        """The version in effect when each of ``count`` tokens was made, one every ``token_s`` from
        ``started`` (None when one version made them all)."""
        if token_s <= 0 or not self._version_changes:
            return None
        changes = [(t, v) for t, v in self._version_changes if t > started]
        if not changes:
            return None
        out, current, pending = [], first, list(changes)
        for i in range(count):
            made_at = started + (i + 1) * token_s
            while pending and pending[0][0] <= made_at:
                current = pending.pop(0)[1]
            out.append(current)
        return out if len(set(out)) > 1 else None

    @property
    def instant(self) -> bool:
        """True when an output is made without waiting (no per-token time, no slot limit): the
        worker may then run a claimed batch through :meth:`generate_now` in one pass."""
        return self._slots is None and not self.token_ms

    def generate_now(self, request: GenerationRequest) -> EngineOutput:
        """The output at once (only while :attr:`instant`): nothing waits, so no abort can arrive
        in between (and none needs registering)."""
        self._inject_faults(request)
        return self._output(request, time.monotonic(), 0.0, self.info.weight_version, aborted=False)

    async def generate(self, request: GenerationRequest, handle: str) -> EngineOutput:
        if self.instant:
            return self.generate_now(request)
        abort_ev = asyncio.Event()  # registered first: an abort while waiting for a slot counts
        self._abort_events[handle] = abort_ev
        try:
            if self._slots is None:
                return await self._generate(request, abort_ev, handle)
            async with self._slots:  # waits for a free slot, like a request in an engine's queue
                return await self._generate(request, abort_ev, handle)
        finally:
            self._abort_events.pop(handle, None)
            self._running.pop(handle, None)
            self._partial_samples.pop(handle, None)

    def partial(self, handle: str) -> SampleOutput | None:
        """The tokens the first sample of ``handle`` has made so far (one every ``token_ms``)."""
        running = self._running.get(handle)
        if running is None:
            return None
        request, started, token_ms = running
        produced = int((time.monotonic() - started) * 1000.0 / token_ms) if token_ms > 0 else 0
        made = self._partial_samples.get(handle)
        if made is None:  # (made once per generation: what a real engine has made, it just reads)
            made = self._partial_samples[handle] = self._sample(_hash_source(request), 0, request.sampling_params,
                                                                request.return_logprob, self._reply(request))
        ids, lps, reason = made
        done = produced >= len(ids)  # (a sample that reached its stop token is finished, not partial)
        produced = min(produced, len(ids))
        return SampleOutput(ids[:produced], lps[:produced] if request.return_logprob else None,
                            reason if done else None)

    async def _generate(self, request: GenerationRequest, abort_ev: asyncio.Event, handle: str) -> EngineOutput:
        self._inject_faults(request)
        weight_version = self.info.weight_version
        token_ms = self._token_ms(request)
        started = time.monotonic()
        self._running[handle] = (request, started, token_ms)
        sp = request.sampling_params
        ends = None
        longest = sp.max_new_tokens
        if sp.stop_token_ids and token_ms > 0:  # (done when its longest sample reaches its stop token)
            source = _hash_source(request)
            ends = [self._sample(source, i, sp, request.return_logprob, self._reply(request)) for i in range(sp.n)]
            longest = max(len(ids) for ids, _, _ in ends)
        budget = longest * token_ms / 1000.0
        if budget > 0:
            try:
                await asyncio.wait_for(abort_ev.wait(), timeout=budget)
            except asyncio.TimeoutError:
                pass
        return self._output(request, started, token_ms, weight_version, aborted=abort_ev.is_set(), ends=ends)

    def _output(self, request: GenerationRequest, started: float, token_ms: float, weight_version: str | None, *,
                aborted: bool, ends: list[tuple[list[int], list[float], str]] | None = None) -> EngineOutput:
        """What a generation that began at ``started`` made: all of it, or (``aborted``) the tokens
        due by now. ``ends``: each sample as :meth:`_sample` gives it, when already made."""
        sp = request.sampling_params
        prompt = _prompt_ids(request) if request.return_prompt_token_ids else None
        if request.input_ids is not None:
            prompt_tokens = len(request.input_ids)
        else:  # (a byte per token)
            prompt_tokens = len(request.prompt.encode()) if request.prompt is not None else len(_text_source(request))
        produced = sp.max_new_tokens
        if aborted:
            elapsed_ms = (time.monotonic() - started) * 1000.0
            produced = min(sp.max_new_tokens, int(elapsed_ms / token_ms)) if token_ms > 0 else 0
        if ends is None:
            source = _hash_source(request)
            ends = [self._sample(source, i, sp, request.return_logprob, self._reply(request)) for i in range(sp.n)]
        samples = []
        made = 0
        for ids, lps, reason in ends:
            if aborted and produced < len(ids):
                ids, lps, reason = ids[:produced], lps[:produced], "abort"
            samples.append(SampleOutput(ids, lps if request.return_logprob else None, reason,
                                        self._versions_of(started, token_ms / 1000.0, len(ids), weight_version),
                                        text=sample_text(self.tokenizer, ids, sp, reason) if request.wants_text else None))
            made += len(ids)
        self.tokens_decoded += made
        return EngineOutput(samples=samples, prompt_tokens=prompt_tokens, weight_version=self.info.weight_version,
                            prompt_token_ids=prompt)


def _refuse_structured(request: GenerationRequest) -> None:
    """The synthetic engine has no grammar: a structured request is refused, naming its field."""
    for key in ("json_schema", "regex", "ebnf", "structural_tag"):
        if getattr(request.sampling_params, key) is not None:
            raise ValidationError(f"sampling_params.{key}", "the synthetic engine has no structured output")
    if request.tools is not None and (request.tool_choice == "required" or isinstance(request.tool_choice, dict)):
        raise ValidationError("tool_choice", "a required or named tool choice needs structured output, which the "
                              "synthetic engine does not have")


def _prompt_ids(request: GenerationRequest) -> list[int]:
    """The prompt as this engine counts it: its ids, else one token per byte of the text (of a
    chat, of its encoded messages, tools and template)."""
    if request.input_ids is not None:
        return list(request.input_ids)
    new = list(request.prompt.encode() if request.prompt is not None else _text_source(request))
    return list(request.prefix_ids or ()) + new


def _hash_source(request: GenerationRequest) -> bytes:
    """What a request's tokens are hashed from: its input and its seed (its request_id without one)."""
    if request.input_ids is not None:
        source = b"ids:" + array("q", request.input_ids).tobytes()
    else:
        source = _text_source(request)
        if request.prefix_ids is not None:
            source = b"prefix:" + array("q", request.prefix_ids).tobytes() + source
    seed = request.sampling_params.sampling_seed
    return b"%s|seed:%s" % (source, str(seed if seed is not None else request.request_id).encode())


def _text_source(request: GenerationRequest) -> bytes:
    """A text or chat prompt as the bytes its tokens derive from."""
    if request.messages is not None:
        rendering = [request.messages, request.tools]
        if request.chat_template is not None or request.chat_template_kwargs is not None:
            rendering += [request.chat_template, request.chat_template_kwargs]
        return b"messages:" + msgspec.msgpack.encode(rendering)
    return b"prompt:" + (request.prompt or "").encode()
