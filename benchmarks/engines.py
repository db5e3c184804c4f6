"""Engine models for the benchmark (not shipped engines).

``SlotEngine``: a continuous-batching engine with a capacity: ``slots`` sequences decode together,
one token each per step of ``token_ms``; a sequence admitted at the start of a step gets its first
token at the end of it; a finished sequence frees its slot at the end of the step, and whatever
is waiting then joins the next step (as SGLang's scheduler admits between forward passes). A
request with ``n`` samples takes ``n`` slots. It counts busy slot-steps, so its occupancy (the
fraction of slot-steps that decoded a token while it had work) says how well its feeder keeps it
full. The stock ``SyntheticEngine`` has no slot limit: every request sleeps on its own.

``CannedEngine``: returns a precomputed output of the requested shape at once (no per-token work
in Python), so a pipeline run with large records measures moving them, not making them.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from dataclasses import dataclass, field

from redroll.engine_worker.engines.base import EngineCapabilities, EngineInfo, EngineOutput, SampleOutput
from redroll.engine_worker.engines.checks import check_token_ids
from redroll.shared.types import GenerationRequest


@dataclass
class _Seq:
    request: GenerationRequest
    handle: str
    future: asyncio.Future
    produced: int = 0
    aborted: bool = False

    @property
    def width(self) -> int:
        return self.request.n


@dataclass
class SlotStats:
    steps: int = 0
    busy_slot_steps: int = 0
    completed: int = 0
    late_s: float = 0.0
    """Time steps started later than the previous one ended (the event loop was busy)."""
    first_step: float | None = None
    last_step: float | None = None
    idle_waits: int = 0
    extra: dict = field(default_factory=dict)


class SlotEngine:
    capabilities = EngineCapabilities()  # (nothing beyond the Engine protocol)

    def __init__(self, *, slots: int = 32, token_ms: float = 10.0, vocab_size: int = 32000,
                 model: str = "synthetic", weight_version: str = "0"):
        self.slots = int(slots)
        self.capacity = self.slots
        self.token_s = float(token_ms) / 1000.0
        self.info = EngineInfo(name="slots", model=model, vocab_size=vocab_size, eos_token_id=None,
                               pad_token_id=None, weight_version=weight_version)
        self.stats = SlotStats()
        self._waiting: deque[_Seq] = deque()
        self._active: list[_Seq] = []
        self._by_handle: dict[str, _Seq] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="slot-engine")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for seq in list(self._active) + list(self._waiting):
            seq.aborted = True
            self._complete(seq)

    def validate(self, request: GenerationRequest) -> None:
        check_token_ids(request, self.info.vocab_size, None)

    def abort(self, handle: str) -> None:
        seq = self._by_handle.get(handle)
        if seq is None:
            return
        seq.aborted = True
        if seq in self._waiting:
            self._waiting.remove(seq)
            self._complete(seq)

    async def generate(self, request: GenerationRequest, handle: str) -> EngineOutput:
        if self._task is None:
            await self.start()
        seq = _Seq(request, handle, asyncio.get_running_loop().create_future())
        self._by_handle[handle] = seq
        self._waiting.append(seq)
        self._wake.set()
        return await seq.future

    @property
    def occupancy(self) -> float:
        s = self.stats
        return s.busy_slot_steps / (s.steps * self.slots) if s.steps else 0.0

    def _complete(self, seq: _Seq) -> None:
        self._by_handle.pop(seq.handle, None)
        if seq.future.done():
            return
        req = seq.request
        k = seq.produced
        reason = "abort" if seq.aborted and k < req.sampling_params.max_new_tokens else "length"
        samples = []
        for i in range(req.n):
            ids = [(hash((req.request_id, i, j)) & 0x7FFF) % (self.info.vocab_size or 32000) for j in range(k)]
            lps = [-0.5] * k if req.return_logprob else None
            samples.append(SampleOutput(ids, lps, reason))
        prompt = len(req.input_ids) if req.input_ids is not None else len((req.prompt or "").encode())
        seq.future.set_result(EngineOutput(samples=samples, prompt_tokens=prompt,
                                           weight_version=self.info.weight_version))
        self.stats.completed += 1

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        step_end = loop.time()
        used = 0
        while True:
            if not self._active and not self._waiting:
                self._wake.clear()
                self.stats.idle_waits += 1
                await self._wake.wait()
                step_end = loop.time()
            # admit what fits (FIFO, no overtaking), finish zero-token requests at once
            while self._waiting and used + self._waiting[0].width <= self.slots:
                seq = self._waiting.popleft()
                if seq.request.sampling_params.max_new_tokens <= 0 or seq.aborted:
                    self._complete(seq)
                    continue
                self._active.append(seq)
                used += seq.width
            if not self._active:
                continue
            # one decode step
            now = loop.time()
            start = max(step_end, now)
            self.stats.late_s += max(0.0, now - step_end)
            step_end = start + self.token_s
            if self.stats.first_step is None:
                self.stats.first_step = time.time()
            await asyncio.sleep(max(0.0, step_end - loop.time()))
            self.stats.steps += 1
            self.stats.busy_slot_steps += used
            self.stats.last_step = time.time()
            still: list[_Seq] = []
            for seq in self._active:
                seq.produced += 1
                if seq.aborted or seq.produced >= seq.request.sampling_params.max_new_tokens:
                    used -= seq.width
                    self._complete(seq)
                else:
                    still.append(seq)
            self._active = still
            # let the callers of the futures just resolved run before the next step starts, so a
            # feeder in this event loop can refill the freed slots in time for it
            await asyncio.sleep(0)
            await asyncio.sleep(0)


class CannedEngine:
    """Returns a precomputed output of the requested shape (``n`` × ``max_new_tokens``) at once."""

    capabilities = EngineCapabilities()  # (nothing beyond the Engine protocol)
    capacity = None  # (it runs whatever it is given at once)

    def __init__(self, *, vocab_size: int = 32000, model: str = "synthetic", weight_version: str = "0"):
        self.info = EngineInfo(name="canned", model=model, vocab_size=vocab_size, eos_token_id=None,
                               pad_token_id=None, weight_version=weight_version)
        self._cache: dict[tuple[int, int, bool], list[SampleOutput]] = {}

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def validate(self, request: GenerationRequest) -> None:
        check_token_ids(request, self.info.vocab_size, None)

    def abort(self, handle: str) -> None:
        return None

    def samples(self, n: int, tokens: int, logprob: bool) -> list[SampleOutput]:
        key = (n, tokens, logprob)
        if key not in self._cache:
            rng = random.Random(1234)
            out = []
            for _ in range(n):
                ids = [rng.randrange(self.info.vocab_size or 32000) for _ in range(tokens)]
                lps = [-rng.random() * 4.0 for _ in range(tokens)] if logprob else None
                out.append(SampleOutput(ids, lps, "length"))
            self._cache[key] = out
        return self._cache[key]

    async def generate(self, request: GenerationRequest, handle: str) -> EngineOutput:
        await asyncio.sleep(0)
        sp = request.sampling_params
        prompt = len(request.input_ids) if request.input_ids is not None else len((request.prompt or "").encode())
        return EngineOutput(samples=self.samples(request.n, sp.max_new_tokens, request.return_logprob),
                            prompt_tokens=prompt, weight_version=self.info.weight_version)
