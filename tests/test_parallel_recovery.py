"""Parallel recovery with poison isolation (``recovery_split`` "halving"), with real processes.

A dead worker's in-flight entries are taken back in bulk by the survivors and run beside their
other work, so the batch costs about one generation after ``claim_idle``; a request that kills
every worker running it is isolated by halving its group at each death and dead-lettered once it
killed a worker alone, while its neighbours finish, none dead-lettered.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections import Counter

import pytest

from redroll.producer.client import make_request, send
from redroll.shared.keys import WORKERS_GROUP
from redroll.shared.types import RecordStatus
from tests.conftest import spawn, stop_process

pytestmark = pytest.mark.slow


async def workers_up(r, settings, n: int, timeout: float = 60.0) -> dict[int, str]:
    """pid → consumer name of the live workers, once ``n`` of them beat."""
    deadline = time.monotonic() + timeout
    while True:
        beats = {json.loads(raw)["pid"]: name.decode() for name, raw in (await r.hgetall(settings.keys.workers)).items()}
        if len(beats) >= n:
            return beats
        assert time.monotonic() < deadline, f"only {len(beats)} of {n} workers started"
        await asyncio.sleep(0.1)


async def pending_by_consumer(r, settings) -> dict[str, list[bytes]]:
    """consumer → the request ids it holds."""
    held: dict[str, list[bytes]] = {}
    for p in await r.xpending_range(settings.keys.requests, WORKERS_GROUP, min="-", max="+", count=10_000):
        (_, fields), = await r.xrange(settings.keys.requests, p["message_id"], p["message_id"])
        held.setdefault(p["consumer"].decode(), []).append(fields[b"rid"])
    return held


async def published(r, settings) -> Counter:
    return Counter(f[b"rid"] for _, f in await r.xrange(settings.keys.results))


async def statuses(r, settings) -> dict[bytes, str]:
    return {f[b"rid"]: f[b"status"].decode() for _, f in await r.xrange(settings.keys.results)}


async def test_a_dead_workers_batch_is_recovered_in_about_one_generation(settings, r, tmp_path):
    """3 workers (5 ms/token, 32 slots), 96 requests of 2 s; SIGKILL the one holding the most:
    its entries all finish within 12 s of the kill (one-at-a-time recovery took ~24 s)."""
    log = tmp_path / "workers.log"
    args = ("worker", "--engine", "synthetic", "--token-ms", "5", "--slots", "32", "--max-inflight", "32")
    procs = [spawn(settings, *args, log=log) for _ in range(3)]
    try:
        names = await workers_up(r, settings, 3)
        sp = {"max_new_tokens": 400}  # 2 s each
        await send(settings, r, [make_request(request_id=f"q-{i}", prompt=f"q{i}", sampling_params=sp)
                                 for i in range(96)])
        deadline = time.monotonic() + 20
        while True:
            held = await pending_by_consumer(r, settings)
            if sum(map(len, held.values())) == 96:
                break
            assert time.monotonic() < deadline, held
            await asyncio.sleep(0.05)
        victim_name = max(held, key=lambda c: len(held[c]))
        victim_rids = set(held[victim_name])
        victim = next(p for p in procs if names.get(p.pid) == victim_name)
        victim.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        victim.wait()
        deadline = killed_at + 30
        while True:
            got = await published(r, settings)
            if all(got[rid] for rid in victim_rids):
                break
            assert time.monotonic() < deadline, f"{sum(1 for x in victim_rids if got[x])}/{len(victim_rids)}"
            await asyncio.sleep(0.05)
        recovered_s = time.monotonic() - killed_at
        print(f"\nrecovery: the {len(victim_rids)} entries of the killed worker all finished {recovered_s:.2f} s "
              f"after the kill (claim_idle {settings.claim_idle_ms / 1000:.1f} s, one generation 2.0 s)")
        deadline = time.monotonic() + 20
        while sum((await published(r, settings)).values()) < 96:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        got = await published(r, settings)
    finally:
        for p in procs:
            if p.poll() is None:
                stop_process(p, 30)
    assert len(victim_rids) >= 28
    assert recovered_s < 12.0
    assert got == Counter({f"q-{i}".encode(): 1 for i in range(96)})  # each once
    assert set((await statuses(r, settings)).values()) == {RecordStatus.FINISHED.value}
    assert await r.xlen(settings.keys.dead) == 0
    assert "took back" in log.read_text() and "running it alone" not in log.read_text()


async def test_a_poison_request_among_48_is_isolated_by_halving(settings, r, tmp_path):
    """A request that kills every worker running it, among 48 (default max_deliveries): it is
    dead-lettered, the 47 others each finish once, none dead-lettered."""
    settings = settings.with_(max_deliveries=5)
    log = tmp_path / "workers.log"
    args = ("worker", "--engine", "synthetic", "--token-ms", "5", "--slots", "16", "--max-inflight", "16",
            "--exit-marker", "KILLER")
    procs = [spawn(settings, *args, log=log) for _ in range(3)]
    deaths = 0
    try:
        await workers_up(r, settings, 3)
        sp = {"max_new_tokens": 100}  # 0.5 s each
        reqs = [make_request(request_id=f"p-{i}", prompt=f"p{i}", sampling_params=sp) for i in range(48)]
        reqs[17] = make_request(request_id="killer", prompt="a KILLER request", sampling_params=sp)
        started = time.monotonic()
        await send(settings, r, reqs)
        deadline = started + 60
        while not await r.xlen(settings.keys.dead):
            assert time.monotonic() < deadline, "the poison request was never dead-lettered"
            for i, p in enumerate(procs):
                if p.poll() is not None:  # a supervisor restarts dead workers
                    assert p.returncode == 86
                    deaths += 1
                    procs[i] = spawn(settings, *args, log=log)
            await asyncio.sleep(0.05)
        isolated_s = time.monotonic() - started
        while sum((await published(r, settings)).values()) < 47:
            assert time.monotonic() < deadline, await published(r, settings)
            await asyncio.sleep(0.1)
        finished_s = time.monotonic() - started
        await asyncio.sleep(1.0)  # anything run twice would show
        got = await published(r, settings)
        print(f"\npoison among 48: dead-lettered {isolated_s:.2f} s after the submit, the 47 others finished "
              f"after {finished_s:.2f} s; {deaths} worker deaths")
    finally:
        for p in procs:
            if p.poll() is None:
                stop_process(p, 30)
    dead = await r.xrange(settings.keys.dead)
    assert [d[1][b"rid"] for d in dead] == [b"killer"]
    assert b"ran alone" in dead[0][1][b"reason"]
    # (the poison's one record is its error record, sent with the dead letter)
    assert got == Counter({r_.request_id.encode(): 1 for r_ in reqs})
    status = await statuses(r, settings)
    assert status.pop(b"killer") == RecordStatus.ERROR.value
    assert set(status.values()) == {RecordStatus.FINISHED.value}
    assert finished_s < 30.0
    assert await r.xlen(settings.keys.requests) == 0
    assert await r.hlen(settings.keys.errors) == 0  # every note cleared
