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

torch and transformers are imported lazily: importing this module needs neither.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from redroll.shared.codec import ValidationError
from redroll.shared.types import GenerationRequest, SamplingParams

from .base import EngineCapabilities, EngineInfo, EngineOutput, SampleOutput, check_token_ids, refuse_extras
from .prefix_cache import KV, PrefixCache
from .tiny_model import TINY_RANDOM
from .torch_weights import TorchWeights

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

log = logging.getLogger(__name__)

ENGINE_NAME = "transformers"

# Sampling features this engine does not implement: refused by validate() rather than ignored.
_UNSUPPORTED_DEFAULTS = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
_UNSUPPORTED_EXTRAS = ("json_schema", "regex", "ebnf", "structural_tag", "stop_regex", "logit_bias")


class _Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


# ---------------------------------------------------------------- bookkeeping


@dataclass(eq=False)
class _Row:
    """One sample of one request inside a running batch."""

    job: "_Job"
    index: int
    seed: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    """The weight version that produced each token (an in-place update swaps between two steps)."""
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    """Per token, the most likely tokens and their logprobs (``top_logprobs_num``)."""
    finish_reason: str | None = None

    @property
    def params(self) -> SamplingParams:
        return self.job.request.sampling_params

    @property
    def active(self) -> bool:
        return self.finish_reason is None and not self.job.future.done()


@dataclass(eq=False)
class _Job:
    """One generate() call: queued, then running as ``n`` rows, then resolved."""

    request: GenerationRequest
    handle: str
    prompt_ids: list[int]
    future: asyncio.Future[EngineOutput]
    rows: list[_Row] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    cached_tokens: int = 0
    """Prompt tokens whose KV this request did not compute: a prefix cache hit, or the whole prompt
    when an earlier request of its batch had the same prompt (that one's prefill served both)."""

    @property
    def width(self) -> int:
        return self.request.sampling_params.n


@dataclass
class _Sampling:
    """Per-row sampling settings of a batch, as tensors on the model's device."""

    temperature: "torch.Tensor"  # [B], 0 = greedy
    top_k: "torch.Tensor"  # [B], vocab size when off
    top_p: "torch.Tensor"  # [B]
    min_p: "torch.Tensor"  # [B]
    generators: list["torch.Generator"]
    top_logprobs: int = 0
    """The largest ``top_logprobs_num`` of the batch (0: none asked)."""


@dataclass
class _Decoder:
    """The tensors one batch carries from step to step."""

    cache: Any
    attention_mask: "torch.Tensor"  # [B, seen]
    next_position: "torch.Tensor"  # [B]
    width: int = 0
    """Prefill width: row i's prompt sits at cache positions ``width - len(prompt) .. width - 1``, its
    j-th generated token (from 0) at ``width + j``."""


@dataclass(eq=False)
class _Prefill:
    """One distinct prompt of a batch with the prefix cache on: prefilled once for all its rows."""

    prompt: tuple[int, ...]
    rows: list[int]
    """The batch rows with this prompt."""
    cached: int = 0
    """Leading prompt tokens whose KV comes from the prefix cache (``past``)."""
    past: KV | None = None
    all_logits: bool = False
    """A row wants prompt logprobs: no cache lookup, every position's logits."""
    kv: KV | None = None
    """Set by the prefill: the whole prompt's KV (``[1, heads, len, head_dim]`` per layer)."""


# ---------------------------------------------------------------- the engine


class TransformersEngine(TorchWeights):
    """Engine protocol on a transformers causal LM (``"tiny-random"`` or a local HF directory)."""

    capabilities = EngineCapabilities(weights_from_disk=True, weights_in_place=True, weights_from_push=True,
                                      weights_from_tensor=True, partial_output=True, progress_counters=True,
                                      prefill_counters=True, tokenizer=True)

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
    ) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if prefix_cache_tokens < 0:
            raise ValueError("prefix_cache_tokens must not be negative")
        self.model_path = model_path
        self.device = device
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.seed = seed
        self.info = EngineInfo(name=ENGINE_NAME, model=model_path, weight_version=weight_version or "0")
        self._model: Any = None
        self._tokenizer: _Tokenizer | None = None
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

    def _load(self) -> tuple[Any, _Tokenizer]:
        import torch

        torch_dtype = getattr(torch, self.dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        tiny_seed = _tiny_seed(self.model_path, self.seed)
        if tiny_seed is not None:
            from .tiny_model import ByteTokenizer, build_tiny_model

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
        if request.input_ids is not None:
            if not request.input_ids:
                raise ValidationError("input_ids", "must not be empty")
            return list(request.input_ids)
        if not request.prompt:
            raise ValidationError("input_ids/prompt", "exactly one of input_ids or prompt is required")
        ids = list(tokenizer.encode(request.prompt))
        if not ids:
            raise ValidationError("prompt", "tokenizes to no tokens")
        max_new = request.sampling_params.max_new_tokens
        if self.info.max_context is not None and len(ids) + max_new > self.info.max_context:
            raise ValidationError(
                "prompt",
                f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new}) exceeds the model context "
                f"of {self.info.max_context}",
            )
        return ids

    @property
    def tokenizer(self) -> _Tokenizer | None:
        """The model's tokenizer (None before :meth:`start`)."""
        return self._tokenizer

    def _require_started(self) -> _Tokenizer:
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
            return self._output(prompt_ids, samples)
        if handle in self._jobs:
            raise ValueError(f"handle {handle!r} is already generating")
        job = _Job(request, handle, prompt_ids, asyncio.get_running_loop().create_future())
        self._jobs[handle] = job
        self._waiting.append(job)
        self._wakeup.set()
        try:
            return await asyncio.shield(job.future)
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
                            row.finish_reason, weight_versions=list(row.versions))

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
            async with self._step_lock:
                version = self.info.weight_version
                tokens, logprobs, tops = await asyncio.to_thread(
                    self._decode_step, decoder, tokens, active, banned, sampling
                )
        if self.prefix_cache is not None:
            await self._store_conversations(rows, decoder, str(version), generation)

    # ------------------------------------------------------------ the prefix cache (event loop)

    async def _prefill_cached(
        self, rows: list[_Row], banned: list[tuple[int, int]], sampling: _Sampling
    ) -> tuple[_Decoder, list[int], list[float], list[list[tuple[int, float]]] | None]:
        """Prefill with the prefix cache (under the step lock): look up each distinct prompt, run
        the suffixes, store the prompts' KV."""
        cache = self.prefix_cache
        assert cache is not None
        version, generation = str(self.info.weight_version), self._weights_generation
        prefills: dict[tuple[int, ...], _Prefill] = {}
        owners: dict[tuple[int, ...], _Job] = {}
        for i, row in enumerate(rows):
            prompt = tuple(row.job.prompt_ids)
            prefill = prefills.setdefault(prompt, _Prefill(prompt, []))
            prefill.rows.append(i)
            prefill.all_logits |= row.index == 0 and row.job.request.logprob_start_len is not None
            owners.setdefault(prompt, row.job)
        for prefill in prefills.values():
            if not prefill.all_logits:  # (prompt logprobs need every position's logits)
                prefill.cached, prefill.past = cache.lookup(prefill.prompt, version, limit=len(prefill.prompt) - 1)
        jobs = list(dict.fromkeys(row.job for row in rows))
        for job in jobs:
            prompt = tuple(job.prompt_ids)
            job.cached_tokens = prefills[prompt].cached if owners[prompt] is job else len(prompt)
            self.prefill_tokens_cached += job.cached_tokens
        result = await asyncio.to_thread(self._prefill_step_cached, rows, list(prefills.values()), banned, sampling)
        if generation == self._weights_generation:
            for prefill in prefills.values():
                if prefill.kv is not None:
                    cache.insert(prefill.prompt, prefill.kv, version)
        return result

    async def _store_conversations(self, rows: list[_Row], decoder: _Decoder, version: str, generation: int) -> None:
        """Store each row's prompt + output but the last token (whose KV was never computed), unless
        the weights changed since the prefill (the KV would mix two versions)."""
        cache = self.prefix_cache
        assert cache is not None
        wanted: dict[tuple[int, ...], int] = {}
        for i, row in enumerate(rows):
            sequence = (*row.job.prompt_ids, *row.token_ids[:-1])
            if len(row.token_ids) > 1 and len(sequence) <= cache.capacity_tokens:
                wanted.setdefault(sequence, i)
        if not wanted or generation != self._weights_generation:
            return
        slices = [(i, len(rows[i].job.prompt_ids), len(sequence)) for sequence, i in wanted.items()]
        kvs = await asyncio.to_thread(_slice_rows, decoder, slices)
        if generation != self._weights_generation:
            return
        for sequence, kv in zip(wanted, kvs):
            cache.insert(sequence, kv, version)

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
        return any(stop in text for stop in row.params.stop)

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

    # ------------------------------------------------------------ torch work (worker thread)

    def _prefill_step(
        self, rows: list[_Row], banned: list[tuple[int, int]], sampling: _Sampling
    ) -> tuple[_Decoder, list[int], list[float], list[list[tuple[int, float]]] | None]:
        """Run the left-padded prompts through the model and sample every row's first token (and
        the prompt logprobs of the jobs that asked for them)."""
        import torch

        device = self._model.device
        prompts = [row.job.prompt_ids for row in rows]
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(rows), width), self._pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            input_ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[i, width - len(prompt) :] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
        self.prefill_tokens_computed += sum(len(p) for p in prompts)
        want_prompt = [row.index == 0 and row.job.request.logprob_start_len is not None for row in rows]
        with torch.inference_mode():
            logits, cache = self._forward(input_ids, attention_mask, position_ids, cache=None,
                                          all_positions=any(want_prompt))
            if any(want_prompt):
                for i, row in enumerate(rows):
                    if want_prompt[i]:
                        row.job.input_logprobs = _prompt_logprobs(logits[i], prompts[i], sampling.temperature[i],
                                                                  row.job.request.logprob_start_len)
                logits = logits[:, -1, :]
            decoder = _Decoder(cache, attention_mask, position_ids[:, -1] + 1, width)
            tokens, logprobs, tops = _sample(logits, sampling, [True] * len(rows), banned, _top_k(rows))
        return decoder, tokens, logprobs, tops

    def _prefill_step_cached(
        self, rows: list[_Row], prefills: list[_Prefill], banned: list[tuple[int, int]], sampling: _Sampling
    ) -> tuple[_Decoder, list[int], list[float], list[list[tuple[int, float]]] | None]:
        """Prefill each distinct prompt alone, on top of its cached prefix, then lay the rows out as
        :meth:`_prefill_step` does (left padded, positions 0..len-1) and sample the first tokens."""
        import torch

        device = self._model.device
        last_logits: list[Any] = [None] * len(rows)
        with torch.inference_mode():
            for prefill in prefills:
                prompt, start = prefill.prompt, prefill.cached
                suffix = torch.tensor([prompt[start:]], dtype=torch.long, device=device)
                positions = torch.arange(start, len(prompt), dtype=torch.long, device=device).unsqueeze(0)
                attention_mask = torch.ones((1, len(prompt)), dtype=torch.long, device=device)
                past = _dynamic_cache(prefill.past) if prefill.past is not None else None
                logits, cache = self._forward(suffix, attention_mask, positions, past, all_positions=prefill.all_logits)
                self.prefill_tokens_computed += suffix.shape[-1]
                prefill.kv = _kv_layers(cache)
                if prefill.all_logits:
                    for i in prefill.rows:
                        row = rows[i]
                        if row.index == 0 and row.job.request.logprob_start_len is not None:
                            row.job.input_logprobs = _prompt_logprobs(logits[0], list(prompt), sampling.temperature[i],
                                                                      row.job.request.logprob_start_len)
                    logits = logits[:, -1, :]
                for i in prefill.rows:
                    last_logits[i] = logits[0]
            lengths = [len(row.job.prompt_ids) for row in rows]
            width = max(lengths)
            attention_mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
            for i, length in enumerate(lengths):
                attention_mask[i, width - length:] = 1
            layers: KV = []
            for layer, (keys0, values0) in enumerate(prefills[0].kv or []):
                keys = keys0.new_zeros((len(rows), keys0.shape[1], width, keys0.shape[3]))
                values = values0.new_zeros((len(rows), values0.shape[1], width, values0.shape[3]))
                for prefill in prefills:
                    k, v = (prefill.kv or [])[layer]
                    for i in prefill.rows:
                        keys[i, :, width - lengths[i]:] = k[0]
                        values[i, :, width - lengths[i]:] = v[0]
                layers.append((keys, values))
            next_position = torch.tensor(lengths, dtype=torch.long, device=device)
            decoder = _Decoder(_dynamic_cache(layers), attention_mask, next_position, width)
            tokens, logprobs, tops = _sample(torch.stack(last_logits), sampling, [True] * len(rows), banned,
                                             _top_k(rows))
        return decoder, tokens, logprobs, tops

    def _decode_step(
        self,
        decoder: _Decoder,
        tokens: list[int],
        active: list[bool],
        banned: list[tuple[int, int]],
        sampling: _Sampling,
    ) -> tuple[list[int], list[float], list[list[tuple[int, float]]] | None]:
        """Feed the last sampled tokens (pad for finished rows) and sample the next ones."""
        import torch

        device = self._model.device
        fed = [token if on else self._pad_id for token, on in zip(tokens, active)]
        input_ids = torch.tensor(fed, dtype=torch.long, device=device).unsqueeze(-1)
        ones = torch.ones((len(fed), 1), dtype=decoder.attention_mask.dtype, device=device)
        with torch.inference_mode():
            decoder.attention_mask = torch.cat([decoder.attention_mask, ones], dim=-1)
            position_ids = decoder.next_position.unsqueeze(-1)
            logits, decoder.cache = self._forward(input_ids, decoder.attention_mask, position_ids, decoder.cache)
            decoder.next_position = decoder.next_position + 1
            return _sample(logits, sampling, active, banned, sampling.top_logprobs)

    def _forward(
        self, input_ids: "torch.Tensor", attention_mask: "torch.Tensor", position_ids: "torch.Tensor", cache: Any,
        all_positions: bool = False,
    ) -> tuple["torch.Tensor", Any]:
        """Last-position logits (float32; every position's with ``all_positions``) and the updated KV cache."""
        kwargs = dict(self._extra_forward_kwargs)
        if all_positions and "logits_to_keep" in kwargs:
            kwargs["logits_to_keep"] = 0  # (0: every position)
        if cache is not None:
            kwargs[self._cache_kwarg] = cache
        out = self._model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True, **kwargs
        )
        new_cache = getattr(out, "cache", None)
        if new_cache is None:
            new_cache = out.past_key_values
        return (out.logits if all_positions else out.logits[:, -1, :]).float(), new_cache


# ---------------------------------------------------------------- KV tensors


def _kv_layers(cache: Any) -> KV:
    """Per layer (keys, values) ``[batch, heads, positions, head_dim]`` of a transformers cache that
    keeps every position (a DynamicCache of full-attention layers); ValueError for any other."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        kinds = {type(layer).__name__ for layer in layers}
        if kinds != {"DynamicLayer"}:
            raise ValueError(f"cache layers {sorted(kinds)} do not keep every position")
        return [(layer.keys, layer.values) for layer in layers]
    if hasattr(cache, "key_cache"):  # transformers 4.x before cache layers
        return list(zip(cache.key_cache, cache.value_cache))
    raise ValueError(f"{type(cache).__name__} is not a dynamic KV cache")


def _dynamic_cache(layers: KV) -> Any:
    """A DynamicCache holding copies of ``layers`` (the tensors given are never written to)."""
    from transformers import DynamicCache

    return DynamicCache([(k, v) for k, v in layers])


def _slice_rows(decoder: _Decoder, slices: list[tuple[int, int, int]]) -> list[KV]:
    """For each (row, prompt length, sequence length), the KV of that row's first ``sequence
    length`` real tokens, copied out of the batch cache (``[1, heads, length, head_dim]``)."""
    import torch

    layers = _kv_layers(decoder.cache)
    out: list[KV] = []
    with torch.inference_mode():
        for row, prompt_length, length in slices:
            start = decoder.width - prompt_length
            out.append([(k[row:row + 1, :, start:start + length].clone(), v[row:row + 1, :, start:start + length].clone())
                        for k, v in layers])
    return out


def _check_prefix_cache_support(model: Any) -> None:
    """Refuse a model whose KV cache does not keep every position of every layer (sliding
    window, linear attention): its KV cannot be sliced by prefix."""
    import torch

    with torch.inference_mode():
        ids = torch.zeros((1, 1), dtype=torch.long, device=model.device)
        out = model(input_ids=ids, use_cache=True)
    cache = getattr(out, "cache", None)
    try:
        _kv_layers(cache if cache is not None else out.past_key_values)
    except ValueError as exc:
        raise ValueError(f"prefix_cache_tokens needs a model with a full-attention KV cache: {exc}") from None


# ---------------------------------------------------------------- sampling


def _top_k(rows: list[_Row]) -> int:
    return max((row.job.request.top_logprobs_num for row in rows), default=0)


def _prompt_logprobs(logits: "torch.Tensor", prompt: list[int], temperature: "torch.Tensor",
                     start: int) -> list[float | None]:
    """The logprob of each prompt token from ``start`` on under ``softmax(logits / T)`` of the
    position before it (the prompt is right-aligned in ``logits`` [width, vocab]); the first
    token has none."""
    import torch

    t = float(temperature) if float(temperature) > 0 else 1.0
    width = logits.shape[0]
    first = width - len(prompt)
    scaled = torch.log_softmax(logits[first:width - 1] / t, dim=-1)
    targets = torch.tensor(prompt[1:], dtype=torch.long, device=logits.device)
    values = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist()
    return ([None] + values)[start:]


def _sample(
    logits: "torch.Tensor", sampling: _Sampling, active: list[bool], banned: list[tuple[int, int]],
    top_logprobs: int = 0,
) -> tuple[list[int], list[float], list[list[tuple[int, float]]] | None]:
    """One token per row, and its logprob under ``softmax(logits / T)`` before any filtering (and
    the ``top_logprobs`` most likely tokens of that distribution).

    Rows are independent: a row's draw depends only on its logits and its own generator, which
    is advanced once per step the row is active and sampling. Greedy rows (T == 0) take the argmax.
    """
    import torch

    temperature = sampling.temperature
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(-1)
    logprobs = torch.log_softmax(scaled, dim=-1)

    masked = scaled
    if banned:
        masked = scaled.clone()
        index = torch.tensor(banned, dtype=torch.long, device=logits.device)
        masked[index[:, 0], index[:, 1]] = float("-inf")

    uniforms = torch.zeros(len(active), dtype=torch.float32, device=logits.device)
    for i, (gen, on, is_greedy) in enumerate(zip(sampling.generators, active, greedy.tolist())):
        if on and not is_greedy:
            uniforms[i] = torch.rand((), generator=gen, device=logits.device)
    tokens = torch.where(greedy, masked.argmax(dim=-1), _filtered_draw(masked, sampling, uniforms))
    chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    tops = None
    if top_logprobs:
        values, ids = logprobs.topk(top_logprobs, dim=-1)
        tops = [list(zip(row_ids, row_values)) for row_ids, row_values in zip(ids.tolist(), values.tolist())]
    return tokens.tolist(), chosen.tolist(), tops


def _filtered_draw(masked: "torch.Tensor", sampling: _Sampling, uniforms: "torch.Tensor") -> "torch.Tensor":
    """Inverse-CDF draw after SGLang-style top-k, top-p and min-p filtering (all from the same probs)."""
    import torch

    probs = torch.softmax(masked, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
    top_p = sampling.top_p.unsqueeze(-1)
    drop = ((sorted_probs.cumsum(dim=-1) - sorted_probs) > top_p) & (top_p < 1.0)
    drop |= ranks >= sampling.top_k.unsqueeze(-1)
    drop |= sorted_probs < sorted_probs[:, :1] * sampling.min_p.unsqueeze(-1)
    drop[:, 0] = False  # the most likely token always survives
    kept = sorted_probs.masked_fill(drop, 0.0)
    cdf = kept.cumsum(dim=-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(-1)
    position = torch.searchsorted(cdf, target, right=True)
    last_kept = (kept > 0).sum(dim=-1, keepdim=True) - 1
    position = torch.minimum(position, last_kept.clamp_min(0))
    return order.gather(-1, position).squeeze(-1)


# ---------------------------------------------------------------- helpers


def _row_seed(params: SamplingParams, index: int) -> int:
    """``sampling_seed + index`` when a seed is given (reproducible, distinct per sample), else random."""
    if params.sampling_seed is None:
        return secrets.randbits(63)
    return params.sampling_seed + index


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
