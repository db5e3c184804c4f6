"""``recovery_split``: how a worker takes back the entries of a consumer that died (in process).

A dead consumer is played by reading entries under its name and never renewing them.
"""

from __future__ import annotations

import asyncio

import pytest
import redis

from redroll.engine_worker.claim import parse_deaths
from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.producer.client import make_request, send
from redroll.shared.keys import WORKERS_GROUP
from redroll.shared.settings import Settings
from redroll.shared.types import RecordStatus
from tests.conftest import run_until_drained, running, wait_until


def test_recovery_split_setting():
    assert Settings().recovery_split == "halving"
    assert Settings.from_env({"REDROLL_RECOVERY_SPLIT": "alone"}).recovery_split == "alone"
    with pytest.raises(ValueError, match="recovery_split"):
        Settings(recovery_split="thirds")


def test_death_notes_parse():
    assert parse_deaths(None) == (0, 0, None, False, None)
    assert parse_deaths(b"3 1 4 0 worker-a-1") == (3, 1, 4, False, "worker-a-1")
    assert parse_deaths("2 1 1 1 w") == (2, 1, 1, True, "w")
    assert parse_deaths(b"garbage") == (0, 0, None, False, None)


async def held_by_dead(settings, r, consumer: str, n: int, prefix: str, tokens: int = 40) -> list[str]:
    """``n`` requests read by ``consumer``, which then "dies"; returns their entry ids."""
    try:
        await r.xgroup_create(settings.keys.requests, WORKERS_GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:  # (created by an earlier call)
        assert "BUSYGROUP" in str(exc)
    await send(settings, r, [make_request(request_id=f"{prefix}-{i}", prompt=f"{prefix}{i}",
                                          sampling_params={"max_new_tokens": tokens}) for i in range(n)])
    read = await r.xreadgroup(WORKERS_GROUP, consumer, {settings.keys.requests: ">"}, count=n)
    return [e.decode() for e, _ in read[0][1]]


async def records(r, settings) -> dict[str, tuple[str, int]]:
    from redroll.shared.codec import decode_record
    out = {}
    for _, f in await r.xrange(settings.keys.results):
        rec = decode_record(f)
        out[rec.request_id] = (rec.status.value, rec.meta_info.get("attempt"))
    return out


async def test_halving_takes_half_of_a_dead_workers_batch_at_once(settings, r):
    settings = settings.with_(max_deliveries=5)
    ids = await held_by_dead(settings, r, "dead-1", 10, "h")
    await asyncio.sleep(settings.claim_idle_ms / 1000 + 0.1)
    worker = Worker(settings, SyntheticEngine(token_ms=50), max_inflight=32, block_ms=100)
    async with running(worker):
        await wait_until(lambda: worker.stats.reclaimed >= 5, 10)
        await asyncio.sleep(0.8)  # another reclaim pass: the group of 5 runs, nothing more joins it
        suspects = [f for f in worker.flights if f.suspect_cap is not None]
        assert len(suspects) == 5 and {f.suspect_cap for f in suspects} == {5}
        assert {f.deliveries for f in suspects} == {1}  # a death in a group is no delivery
        # The first survivor notes the death for the whole batch, taken or not.
        notes = await r.hmget(settings.keys.errors, [f"{i}#deaths" for i in ids])
        assert set(notes) == {b"1 0 5 0 dead-1"}
        await wait_until(lambda: worker.stats.published == 10, 15)
    got = await records(r, settings)
    # each ran twice (on the dead worker, then here): the record says so though the count stayed 1
    assert got == {f"h-{i}": ("finished", 2) for i in range(10)}
    assert await r.hlen(settings.keys.errors) == 0 and await r.xlen(settings.keys.dead) == 0


async def test_only_an_entry_whose_worker_died_while_it_ran_alone_is_dead_lettered(settings, r):
    settings = settings.with_(max_deliveries=5)
    (alone,) = await held_by_dead(settings, r, "dead-1", 1, "alone")
    pair = await held_by_dead(settings, r, "dead-2", 2, "pair")
    # Both have witnessed 4 deaths; the lone one was already down to running alone, the pair in
    # groups of 2: the pair's 5th death was in a group, so neither of them is dead-lettered.
    await r.hset(settings.keys.errors, mapping={f"{alone}#deaths": "4 1 1 1 dead-0",
                                                **{f"{e}#deaths": "4 0 2 0 dead-0" for e in pair}})
    await asyncio.sleep(settings.claim_idle_ms / 1000 + 0.1)
    worker = Worker(settings, SyntheticEngine(token_ms=5), max_inflight=8, block_ms=100)
    await run_until_drained(worker, timeout=30)
    assert worker.stats.dead_lettered == 1 and worker.stats.published == 2
    dead = await r.xrange(settings.keys.dead)
    assert [d[1][b"rid"] for d in dead] == [b"alone-0"]
    assert b"its worker died while it ran alone: 5 worker deaths witnessed" in dead[0][1][b"reason"]
    got = await records(r, settings)
    assert got["alone-0"][0] == RecordStatus.ERROR.value
    assert got["pair-0"] == got["pair-1"] == ("finished", 6)  # 1 delivery + 5 deaths witnessed in groups
    assert await r.hlen(settings.keys.errors) == 0


async def test_alone_takes_suspects_one_at_a_time(settings, r, caplog):
    settings = settings.with_(recovery_split="alone", max_deliveries=5)
    await held_by_dead(settings, r, "dead-1", 3, "a", tokens=4)
    await asyncio.sleep(settings.claim_idle_ms / 1000 + 0.1)
    worker = Worker(settings, SyntheticEngine(token_ms=20), max_inflight=8, block_ms=100)
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, len(worker.flights))
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    await run_until_drained(worker, timeout=30)
    watcher.cancel()
    assert worker.stats.published == 3
    assert peak == 1
    assert caplog.text.count("running it alone") == 3
    assert await records(r, settings) == {f"a-{i}": ("finished", 2) for i in range(3)}
