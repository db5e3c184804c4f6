"""A plain PyTorch/transformers engine: static batches, its own decoding loop, exact logprobs.

Meant for CPU runs, tests and small models, not for throughput. Requests waiting when a batch
starts are decoded together (up to ``max_batch_size`` rows, one row per sample); requests that
arrive meanwhile wait for the next batch. A request wider than ``max_batch_size`` runs alone.

Decoding is done here rather than with ``model.generate`` so that every knob is explicit:
left padding with an attention mask and explicit position ids, a KV cache, and per-row
temperature / top-k / top-p / min-p / stops / seeds. The logprob of a sampled token is
``log_softmax(logits / T)[token]`` (``T = 1`` for greedy), taken before min-new-tokens masking and
before top-k/top-p/min-p filtering, so a teacher-forced forward pass reproduces it.

With ``prefix_cache_tokens`` > 0 the engine keeps an LRU of prompt (and prompt + output) KV
(:mod:`.prefix_cache`, SGLang's radix cache in spirit): prefill then runs one distinct prompt at a
time, only its uncached suffix through the model (at least its last token), and stacks the rows
into the left-padded batch cache. Rows of one prompt share one prefill. A finished batch stores
each row's prompt + output (all but the last token), so a conversation's next turn hits its whole
history. Any weight change empties it. ``prefill_tokens_computed`` / ``prefill_tokens_cached``
count the prompt tokens fed to the model / served without it; each output's ``cached_tokens``
is its request's share of the latter.

The engine is this module (lifecycle, validation, queueing and batching, results) and, by
concern: :mod:`.transformers_batch` (the bookkeeping of a batch), :mod:`.transformers_steps` (the
model steps and their KV tensors, a mixin), :mod:`.transformers_sampling` (token sampling and
logprobs) and :mod:`.torch_weights` (new weights, a mixin).

torch and transformers are imported lazily: importing this module needs neither.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
from typing import TYPE_CHECKING, Any

from redroll.engine_worker.engines.base import EngineCapabilities, EngineInfo, EngineOutput, SampleOutput, Tokenizer
from redroll.engine_worker.engines.checks import check_context, check_token_ids, refuse_extras
from redroll.engine_worker.engines.prefix_cache import PrefixCache
from redroll.engine_worker.engines.text import add_text, find_stop, prompt_token_ids
from redroll.engine_worker.engines.tiny_model import TINY_RANDOM
from redroll.engine_worker.engines.torch_weights import TorchWeights
from redroll.engine_worker.engines.transformers_batch import _Job, _Row, _Sampling
from redroll.engine_worker.engines.transformers_sampling import _row_seed, _top_k
from redroll.engine_worker.engines.transformers_steps import TransformersSteps, _check_prefix_cache_support
from redroll.engine_worker.engines.transformers_structured import TransformersStructured
from redroll.shared.codec import ValidationError
from redroll.shared.types import GenerationRequest

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

log = logging.getLogger(__name__)

ENGINE_NAME = "transformers"

# Sampling features this engine does not implement: refused by validate() rather than ignored.
_UNSUPPORTED_DEFAULTS = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
_UNSUPPORTED_EXTRAS = ("structural_tag", "stop_regex", "logit_bias")


# ---------------------------------------------------------------- the engine


class TransformersEngine(TransformersSteps, TransformersStructured, TorchWeights):
    """Engine protocol on a transformers causal LM (``"tiny-random"`` or a local HF directory)."""

    capabilities = EngineCapabilities(weights_from_disk=True, weights_in_place=True, weights_from_push=True,
                                      weights_from_tensor=True, partial_output=True, progress_counters=True,
                                      prefill_counters=True, tokenizer=True,
                                      grammar_resume=True)

    def __init__(
        self,
        model_path: str = TINY_RANDOM,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_batch_size: int = 32,
        weight_version: str | None = None,
        seed: int = 0,
        prefix_cache_tokens: int = 0,
        tool_call_parser: str | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if prefix_cache_tokens < 0:
            raise ValueError("prefix_cache_tokens must not be negative")
        self.model_path = model_path
        self.device = device
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.capacity = max_batch_size
        """The engine contract's capacity: rows decoded together (a request takes one row per sample)."""
        self.seed = seed
        self.info = EngineInfo(name=ENGINE_NAME, model=model_path, weight_version=weight_version or "0")
        self._model: Any = None
        self._tokenizer: Tokenizer | None = None
        self._eos_ids: frozenset[int] = frozenset()
        self._pad_id = 0
        self._cache_kwarg = "past_key_values"
        self._extra_forward_kwargs: dict[str, Any] = {}
        self._waiting: collections.deque[_Job] = collections.deque()
        self._jobs: dict[str, _Job] = {}
        self._wakeup = asyncio.Event()
        self._batcher: asyncio.Task[None] | None = None
        self._step_lock = asyncio.Lock()
        """Held by every model step and by an in-place weight swap (so the swap falls between steps)."""
        self.prefix_cache: PrefixCache | None = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None
        """KV of recent prompts and conversations (``prefix_cache_tokens`` tokens at most); None: off."""
        self.tokens_decoded = 0
        """Output tokens this engine's model produced, one per row per step (the honest count of
        decode work: a resumed request adds only what it made after its checkpoint)."""
        self.prefill_tokens_computed = 0
        """Prompt tokens fed to the model by prefill forwards (padding not counted)."""
        self.prefill_tokens_cached = 0
        """Prompt tokens whose KV prefill took from the prefix cache or from a same-prompt request."""
        self._weights_generation = 0
        """Bumped by every weight change: KV computed under an older generation is never stored."""
        self._set_tool_call_parser(tool_call_parser)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Load the model (off the event loop) and start the batcher."""
        if self._batcher is not None:
            return
        _import_model_classes()
        model, tokenizer = await asyncio.to_thread(self._load)
        if self.prefix_cache is not None:
            await asyncio.to_thread(_check_prefix_cache_support, model)
        self._model, self._tokenizer = model, tokenizer
        self._fill_info(model, tokenizer)
        self._tokens_changed()
        self._cache_kwarg, self._extra_forward_kwargs = _forward_conventions(model)
        self._batcher = asyncio.create_task(self._run_batcher(), name="transformers-engine-batcher")

    async def close(self) -> None:
        """Stop the batcher; whatever is queued or running returns with finish reason "abort"."""
        batcher, self._batcher = self._batcher, None
        if batcher is not None:
            batcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await batcher
        for job in list(self._jobs.values()):
            self._resolve_aborted(job)
        self._waiting.clear()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def _load(self) -> tuple[Any, Tokenizer]:
        import torch

        torch_dtype = getattr(torch, self.dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        tiny_seed = _tiny_seed(self.model_path, self.seed)
        if tiny_seed is not None:
            from redroll.engine_worker.engines.tiny_model import ByteTokenizer, build_tiny_model

            model = build_tiny_model(tiny_seed).to(device=self.device, dtype=torch_dtype)
            return model, ByteTokenizer()
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dtype_key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            self.model_path, local_files_only=True, **{dtype_key: torch_dtype}
        )
        return model.to(self.device).eval(), tokenizer

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None, *,
                                       in_place: bool = False) -> None:
        """Load new weights (a local HF directory, or ``tiny-random[:SEED]``): ``in_place``, swapped
        between two decode steps while requests run (see :mod:`.torch_weights`); otherwise while
        nothing is in flight (the worker quiesces first), replacing the model.
        """
        if in_place:
            await self.load_weights_in_place(model_path, weight_version)
            return
        if self._jobs:
            raise RuntimeError("cannot update weights while requests are in flight")
        previous = self.model_path
        self.model_path = model_path
        _import_model_classes()
        try:
            model, tokenizer = await asyncio.to_thread(self._load)
            if self.prefix_cache is not None:
                await asyncio.to_thread(_check_prefix_cache_support, model)
        except Exception:
            self.model_path = previous
            raise
        self._model, self._tokenizer = model, tokenizer
        self._fill_info(model, tokenizer)
        self._tokens_changed()
        self.info.weight_version = weight_version if weight_version is not None else model_path
        self._weights_changed()

    def _weights_changed(self) -> None:
        """New weights (any source, in place or not): KV computed with the old ones is dropped."""
        self._weights_generation += 1
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def _fill_info(self, model: Any, tokenizer: Any) -> None:
        config = model.config
        eos = {tokenizer.eos_token_id, *_as_ids(getattr(model.generation_config, "eos_token_id", None))}
        self._eos_ids = frozenset(t for t in eos if t is not None)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._pad_id = pad if pad is not None else 0
        self.info.vocab_size = config.vocab_size
        self.info.eos_token_id = tokenizer.eos_token_id
        self.info.pad_token_id = self._pad_id
        self.info.max_context = getattr(config, "max_position_embeddings", None)

    # ------------------------------------------------------------ validation

    def validate(self, request: GenerationRequest) -> None:
        """Raise :class:`ValidationError` for requests this engine cannot serve."""
        self._prompt_ids(request)

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        """Validate ``request`` and return its prompt token ids (the prompt tokenized here)."""
        tokenizer = self._require_started()
        check_token_ids(request, self.info.vocab_size, self.info.max_context)
        _check_supported(request)
        refuse_extras(request, "transformers", top_logprobs=True, prompt_logprobs=True)
        self._check_structured(request)
        if request.input_ids is not None:
            if not request.input_ids:
                raise ValidationError("input_ids", "must not be empty")
            return list(request.input_ids)
        if request.messages is not None or request.prompt:
            ids = prompt_token_ids(tokenizer, request, ENGINE_NAME) or []
        else:
            raise ValidationError("input_ids/prompt/messages", "exactly one of input_ids, prompt or messages is required")
        if not ids:
            raise ValidationError("prompt", "tokenizes to no tokens")
        check_context(request, len(ids), self.info.max_context)
        return ids

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer (None before :meth:`start`)."""
        return self._tokenizer

    def _require_started(self) -> Tokenizer:
        if self._tokenizer is None:
            raise RuntimeError("TransformersEngine.start() has not been called")
        return self._tokenizer

    # ------------------------------------------------------------ generate / abort

    async def generate(self, request: GenerationRequest, handle: str) -> EngineOutput:
        """Queue ``request`` for the next batch and wait for its samples."""
        prompt_ids = self._prompt_ids(request)
        if self._batcher is None:
            raise RuntimeError("the engine is closed")
        if request.sampling_params.max_new_tokens == 0:
            samples = [self._empty_sample(request, "length") for _ in range(request.n)]
            return add_text(self._output(prompt_ids, samples), request, self._tokenizer)
        if handle in self._jobs:
            raise ValueError(f"handle {handle!r} is already generating")
        job = _Job(request, handle, prompt_ids, asyncio.get_running_loop().create_future())
        self._jobs[handle] = job
        self._waiting.append(job)
        self._wakeup.set()
        try:
            return add_text(await asyncio.shield(job.future), request, self._tokenizer)
        except asyncio.CancelledError:
            self.abort(handle)
            raise
        finally:
            if self._jobs.get(handle) is job:
                del self._jobs[handle]

    def abort(self, handle: str) -> None:
        """Stop one request: queued ones return no tokens, running ones their partial tokens."""
        job = self._jobs.get(handle)
        if job is None:
            return
        with contextlib.suppress(ValueError):
            self._waiting.remove(job)
        self._resolve_aborted(job)

    def partial(self, handle: str) -> SampleOutput | None:
        """What the first sample of ``handle`` has made so far (copies: the rows keep growing);
        None before it runs. Resumable requests are checkpointed from this."""
        job = self._jobs.get(handle)
        if job is None or not job.rows:
            return None
        row = job.rows[0]
        return SampleOutput(list(row.token_ids), list(row.logprobs) if job.request.return_logprob else None,
                            row.finish_reason, weight_versions=list(row.versions),
                            top_logprobs=[list(t) for t in row.top] if job.request.top_logprobs_num else None)

    def progress(self, handle: str) -> int | None:
        """Tokens generated so far by the longest sample of ``handle``; ``None`` if unknown."""
        job = self._jobs.get(handle)
        if job is None:
            return None
        return max((len(row.token_ids) for row in job.rows), default=0)

    # ------------------------------------------------------------ results

    def _resolve_aborted(self, job: _Job) -> None:
        if job.future.done():
            return
        for row in job.rows:
            if row.finish_reason is None:
                row.finish_reason = "abort"
        if job.rows:
            self._resolve(job)
        else:
            samples = [self._empty_sample(job.request, "abort") for _ in range(job.width)]
            job.future.set_result(self._output(job.prompt_ids, samples))

    def _resolve(self, job: _Job) -> None:
        current = str(self.info.weight_version)
        # Per-token versions for every sample once any token was not made by the record's version
        # (a sample that ended before an in-place swap is all old, its sibling spans it).
        mixed = any(set(row.versions) - {current} for row in job.rows)
        samples = [
            SampleOutput(
                token_ids=list(row.token_ids),
                logprobs=list(row.logprobs) if job.request.return_logprob else None,
                finish_reason=row.finish_reason,
                weight_versions=list(row.versions) if mixed else None,
                top_logprobs=[list(t) for t in row.top] if job.request.top_logprobs_num else None,
            )
            for row in job.rows
        ]
        if not job.future.done():
            output = self._output(job.prompt_ids, samples, job.cached_tokens)
            output.input_logprobs = job.input_logprobs
            job.future.set_result(output)

    def _output(self, prompt_ids: list[int], samples: list[SampleOutput], cached_tokens: int = 0) -> EngineOutput:
        return EngineOutput(
            samples=samples,
            prompt_tokens=len(prompt_ids),
            cached_tokens=cached_tokens,
            weight_version=self.info.weight_version,
            prompt_token_ids=prompt_ids,
        )

    @staticmethod
    def _empty_sample(request: GenerationRequest, reason: str) -> SampleOutput:
        return SampleOutput(token_ids=[], logprobs=[] if request.return_logprob else None, finish_reason=reason)

    # ------------------------------------------------------------ batching

    async def _run_batcher(self) -> None:
        while True:
            while not self._waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
            await asyncio.sleep(0)  # let requests submitted in the same tick join this batch
            batch = self._take_batch()
            if not batch:
                continue
            try:
                await self._run_batch(batch)
            except Exception as exc:  # a failed forward fails its batch, not the engine
                log.exception("transformers engine batch failed")
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(exc)

    def _take_batch(self) -> list[_Job]:
        """Waiting jobs in order, up to ``max_batch_size`` rows (a wider job goes alone)."""
        batch: list[_Job] = []
        rows = 0
        while self._waiting:
            job = self._waiting[0]
            if batch and rows + job.width > self.max_batch_size:
                break
            self._waiting.popleft()
            batch.append(job)
            rows += job.width
        return batch

    async def _run_batch(self, jobs: list[_Job]) -> None:
        rows = [_Row(job, i, _row_seed(job.request.sampling_params, i)) for job in jobs for i in range(job.width)]
        for job in jobs:
            job.rows = [row for row in rows if row.job is job]
        sampling = self._sampling_tensors(rows)
        banned = self._banned_tokens(rows)
        self._attach_grammars(rows)
        sampling.allowed = self._allowed(rows)
        # Each step runs under the step lock, with the version it ran on: an in-place weight swap
        # takes the lock, so it falls between two steps.
        async with self._step_lock:
            version = self.info.weight_version
            generation = self._weights_generation
            if self.prefix_cache is None:
                decoder, tokens, logprobs, tops = await asyncio.to_thread(self._prefill_step, rows, banned, sampling)
            else:
                decoder, tokens, logprobs, tops = await self._prefill_cached(rows, banned, sampling)
        while True:
            self._advance(rows, tokens, logprobs, tops, version)
            active = [row.active for row in rows]
            if not any(active):
                break
            banned = self._banned_tokens(rows)
            sampling.allowed = self._allowed(rows)
            async with self._step_lock:
                version = self.info.weight_version
                tokens, logprobs, tops = await asyncio.to_thread(
                    self._decode_step, decoder, tokens, active, banned, sampling
                )
        if self.prefix_cache is not None:
            await self._store_conversations(rows, decoder, str(version), generation)

    # ------------------------------------------------------------ per-step bookkeeping (event loop)

    def _advance(self, rows: list[_Row], tokens: list[int], logprobs: list[float],
                 tops: list[list[tuple[int, float]]] | None, version: str | None) -> None:
        """Append this step's token to every active row, finish rows, resolve finished jobs."""
        touched: list[_Job] = []
        for i, (row, token, logprob) in enumerate(zip(rows, tokens, logprobs)):
            if not row.active:
                continue
            row.token_ids.append(token)
            row.logprobs.append(logprob)
            if row.grammar is not None:
                row.grammar.advance(token)
            self.tokens_decoded += 1
            if tops is not None and row.job.request.top_logprobs_num:
                row.top.append(tops[i][:row.job.request.top_logprobs_num])
            row.versions.append(str(version))
            row.finish_reason = self._finish_reason(row, token)
            if row.finish_reason is not None and row.job not in touched:
                touched.append(row.job)
        for job in touched:
            if all(row.finish_reason is not None for row in job.rows):
                self._resolve(job)

    def _finish_reason(self, row: _Row, token: int) -> str | None:
        params = row.params
        produced = len(row.token_ids)
        if produced >= params.min_new_tokens:
            if token in params.stop_token_ids or (not params.ignore_eos and token in self._eos_ids):
                return "stop"
            if params.stop and self._hits_stop_string(row):
                return "stop"
        if produced >= params.max_new_tokens:
            return "length"
        return None

    def _hits_stop_string(self, row: _Row) -> bool:
        tokenizer = self._require_started()
        text = tokenizer.decode(row.token_ids, skip_special_tokens=row.params.skip_special_tokens)
        return find_stop(text, row.params.stop) is not None

    def _banned_tokens(self, rows: list[_Row]) -> list[tuple[int, int]]:
        """(row, token) pairs that may not be sampled next: stops before ``min_new_tokens``."""
        banned: list[tuple[int, int]] = []
        for i, row in enumerate(rows):
            params = row.params
            if not row.active or len(row.token_ids) >= params.min_new_tokens:
                continue
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self._eos_ids))
            banned.extend((i, token) for token in sorted(stops))
        return banned

    def _sampling_tensors(self, rows: list[_Row]) -> _Sampling:
        import torch

        device = self._model.device
        vocab = self.info.vocab_size

        def column(values: list[float], dtype: "torch.dtype") -> "torch.Tensor":
            return torch.tensor(values, dtype=dtype, device=device)

        params = [row.params for row in rows]
        return _Sampling(
            temperature=column([p.temperature for p in params], torch.float32),
            top_k=column([p.top_k if p.top_k > 0 else vocab for p in params], torch.long),
            top_p=column([p.top_p for p in params], torch.float32),
            min_p=column([p.min_p for p in params], torch.float32),
            generators=[torch.Generator(device=device).manual_seed(row.seed) for row in rows],
            top_logprobs=_top_k(rows),
        )


# ---------------------------------------------------------------- helpers


def _check_supported(request: GenerationRequest) -> None:
    params = request.sampling_params
    for name, default in _UNSUPPORTED_DEFAULTS.items():
        if getattr(params, name) != default:
            raise ValidationError(f"sampling_params.{name}", "not supported by the transformers engine")
    for name in _UNSUPPORTED_EXTRAS:
        if params.extra.get(name) is not None:
            raise ValidationError(f"sampling_params.{name}", "not supported by the transformers engine")
    if request.lora_path is not None:
        raise ValidationError("lora_path", "LoRA adapters are not supported by the transformers engine")


def _forward_conventions(model: Any) -> tuple[str, dict[str, Any]]:
    """The KV-cache keyword of ``model.forward`` and extra keywords it accepts, from its signature.

    transformers 5.x renamed ``past_key_values`` to ``cache`` (the old name still works, with a
    deprecation warning); ``logits_to_keep`` (4.50+) spares the lm_head over the whole prompt.
    """
    parameters = inspect.signature(model.forward).parameters
    cache_kwarg = "cache" if "cache" in parameters else "past_key_values"
    extra = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}
    return cache_kwarg, extra


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


__all__ = ["ENGINE_NAME", "TransformersEngine"]


def _tiny_seed(model_path: str, default_seed: int) -> int | None:
    """``tiny-random`` → the engine's seed; ``tiny-random:7`` → 7; anything else → None."""
    if model_path == TINY_RANDOM:
        return default_seed
    prefix = TINY_RANDOM + ":"
    if model_path.startswith(prefix) and model_path[len(prefix):].isdigit():
        return int(model_path[len(prefix):])
    return None


def _import_model_classes() -> None:
    """Import the transformers classes on the calling (event loop) thread.

    transformers resolves its lazy attributes without a lock: two engines loading in two threads
    at once can see ``from transformers import LlamaConfig`` fail. Resolving them here, before
    the loading thread starts, avoids that race.
    """
    import transformers

    for name in ("LlamaConfig", "LlamaForCausalLM", "AutoModelForCausalLM", "AutoTokenizer"):
        getattr(transformers, name)
