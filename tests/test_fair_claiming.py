"""Fair claiming (issue 44): a worker claims what its engine can start now plus a small prefetch
(``claim_prefetch``), so a burst spreads over idle workers, while one worker under steady load still
keeps its engine full."""

from __future__ import annotations

import asyncio
import time

import pytest

from redroll.engine_worker.claim import claim_limit, default_max_inflight, engine_capacity
from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.producer.client import make_request, send
from redroll.shared.settings import Settings
from tests.conftest import run_until_drained, wait_until


class WatchedEngine(SyntheticEngine):
    """A synthetic engine that records how many requests it held (waiting for a slot or running)
    and ran at once, and when each generation ran."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.held = self.peak_held = 0
        self.running = self.peak_running = 0
        self.spans: list[tuple[float, float]] = []

    async def generate(self, request, handle):
        self.held += 1
        self.peak_held = max(self.peak_held, self.held)
        try:
            return await super().generate(request, handle)
        finally:
            self.held -= 1

    async def _generate(self, request, abort_ev, handle):
        self.running += 1
        self.peak_running = max(self.peak_running, self.running)
        began = time.monotonic()
        try:
            return await super()._generate(request, abort_ev, handle)
        finally:
            self.running -= 1
            self.spans.append((began, time.monotonic()))


def requests(n: int, tokens: int, tag: str) -> list:
    return [make_request(request_id=f"{tag}-{i}", prompt="x", sampling_params={"max_new_tokens": tokens})
            for i in range(n)]


async def blocked_reads(r) -> int:
    """Clients blocked in XREADGROUP now (idle workers waiting for work)."""
    return sum(1 for c in await r.client_list() if c.get("cmd") == "xreadgroup" and "b" in c.get("flags", ""))


async def test_a_burst_spreads_over_idle_workers(settings, r):
    """The issue's case: two idle workers, 16 slots each, max_inflight 32, a burst of 32 one-second
    requests (20 tokens x 50 ms). Today all 32 went to the first worker to wake."""
    engines = [WatchedEngine(token_ms=50, slots=16) for _ in range(2)]
    fleet = [Worker(settings, e, max_inflight=32, block_ms=1000) for e in engines]
    tasks = [asyncio.create_task(w.run()) for w in fleet]
    try:
        await asyncio.wait_for(asyncio.gather(*(w.started.wait() for w in fleet)), 10)
        await wait_until(lambda: _both_blocked(r), timeout=10, interval=0.01)
        await send(settings, r, requests(32, 20, "burst"))
        await wait_until(lambda: sum(w.stats.published for w in fleet) == 32, timeout=20)
        took = [w.stats.claimed + w.stats.reclaimed for w in fleet]
        print(f"burst of 32 over 2 idle workers: {took[0]}/{took[1]}; engine peaks (held, running): "
              f"{[(e.peak_held, e.peak_running) for e in engines]}")
        assert sum(took) == 32
        assert min(took) >= 8, f"a burst of 32 went {took[0]}/{took[1]}"
        # Nobody took more than its 16 slots plus the default prefetch.
        assert max(took) <= 16 + settings.claim_prefetch
    finally:
        for w in fleet:
            w.request_stop()
        await asyncio.wait_for(asyncio.gather(*tasks), 20)


async def _both_blocked(r) -> bool:
    return await blocked_reads(r) >= 2


async def test_one_worker_under_steady_load_keeps_its_engine_full(settings, r):
    """No throughput regression: 64 requests (10 tokens x 40 ms) on one worker with 16 slots keep
    16 running, with no more than the prefetch waiting in the engine."""
    engine = WatchedEngine(token_ms=40, slots=16)
    worker = Worker(settings, engine, max_inflight=32, block_ms=200)
    await send(settings, r, requests(64, 10, "steady"))
    await run_until_drained(worker, timeout=60)  # (a burst worker: it stops once all 64 are done)
    assert worker.stats.published == 64
    first = min(b for b, _ in engine.spans)
    last = max(e for _, e in engine.spans)
    busy = sum(e - b for b, e in engine.spans) / (16 * (last - first))
    print(f"steady load, 64 on one worker: peak running {engine.peak_running}, peak held "
          f"{engine.peak_held}, slot utilisation {busy:.2f} over {last - first:.2f}s")
    assert engine.peak_running == 16
    assert engine.peak_held <= 16 + settings.claim_prefetch
    assert busy >= 0.75


def test_the_claim_limit_rule():
    prefetch = Settings().claim_prefetch
    assert prefetch == 2
    # The engine's declared capacity plus the prefetch, never above max_inflight.
    assert claim_limit(engine_capacity(SyntheticEngine(token_ms=1, slots=16)), 32, prefetch) == 18
    assert claim_limit(16, 32, 0) == 16
    assert claim_limit(64, 32, prefetch) == 32
    # An engine that runs whatever it is given (capacity None): max_inflight, 32 unless given.
    assert engine_capacity(SyntheticEngine(token_ms=1)) is None
    assert claim_limit(None, 7, prefetch) == 7
    assert default_max_inflight(None, prefetch) == 32
    # Unless given, max_inflight follows the engine: a vLLM engine batching 256 holds 256 + the prefetch.
    assert default_max_inflight(256, prefetch) == 258

    class Declared:
        capacity = 10

    class Undeclared:
        def engine_kwargs(self):  # (no longer probed: capacity is declared, or the engine is refused)
            return {"max_num_seqs": 12}

    class Wrong:
        capacity = 0

    assert engine_capacity(Declared()) == 10
    with pytest.raises(TypeError, match="Undeclared declares no capacity"):
        engine_capacity(Undeclared())
    with pytest.raises(TypeError, match="Wrong.capacity is 0"):
        engine_capacity(Wrong())

def test_claim_prefetch_setting():
    assert Settings.from_env({"REDROLL_CLAIM_PREFETCH": "5"}).claim_prefetch == 5
    try:
        Settings(claim_prefetch=-1)
    except ValueError as exc:
        assert "claim_prefetch" in str(exc)
    else:
        raise AssertionError("a negative prefetch was accepted")
