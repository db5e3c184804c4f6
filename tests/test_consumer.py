"""Consumer-group runner against a real redis-server: exactly-once application in the normal
case, retries, dead letters, de-duplication, recovery, sharing, trimming, and the CLI process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from collections import Counter

import pytest

from redroll.consumer import runner as runner_module
from redroll.consumer.batch import APPLY_BYTES, BatchApplier
from redroll.consumer.runner import ConsumerRunner
from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.ops.retention import trim_acked
from redroll.producer.client import make_request, send
from redroll.shared.types import RecordStatus
from tests.conftest import run_until_drained, spawn, wait_until

SP = {"max_new_tokens": 3}


async def produce(settings, r, rids, callback="h", **fields) -> list:
    """Queue requests whose records go to ``{ns}:results`` and let a worker publish them all."""
    await send(settings, r, [make_request(request_id=x, prompt=x, sampling_params=SP, callback=callback, **fields)
                             for x in rids])
    await run_until_drained(Worker(settings, SyntheticEngine(), block_ms=100), timeout=30)
    return await r.xrange(settings.keys.results)


async def _xlen_at_least(r, key, n):
    return await r.xlen(key) >= n


@contextlib.asynccontextmanager
async def running(runner: ConsumerRunner):
    task = asyncio.create_task(runner.run())
    try:
        yield runner
    finally:
        runner.request_stop()
        await asyncio.wait_for(task, 10)


def fast(settings, **kw):
    """Short claim_idle so retry and recovery paths run in well under a second per step."""
    return settings.with_(claim_idle_ms=kw.pop("claim_idle_ms", 300), **kw)


async def group_pending(r, stream, group) -> int:
    return int((await r.xpending(stream, group))["pending"])


async def dead_entries(r, settings) -> list[dict]:
    return [{k.decode(): v for k, v in f.items()} for _i, f in await r.xrange(settings.keys.dead)]


# ---------------------------------------------------------------- normal path


async def test_applies_each_record_once_and_acks(settings, r):
    sync_rids = [f"s-{i}" for i in range(10)]
    async_rids = [f"a-{i}" for i in range(10)]
    await produce(settings, r, sync_rids, callback="h")
    await produce(settings, r, async_rids, callback="ah")
    applied: Counter = Counter()

    def h(rec):
        assert rec.status is RecordStatus.FINISHED and len(rec.output_token_ids[0]) == 3
        applied[rec.request_id] += 1

    async def ah(rec):
        await asyncio.sleep(0.001)
        applied[rec.request_id] += 1

    runner = ConsumerRunner(settings, group="g", handlers={"h": h, "ah": ah}, block_ms=100)
    await run_until_drained(runner, timeout=30)  # (stops once nothing is left: no duplicate can follow)
    assert applied == Counter({x: 1 for x in sync_rids + async_rids})
    assert runner.stats.applied == 20 and runner.stats.dead_lettered == 0
    assert await group_pending(r, settings.keys.results, "g") == 0
    assert await r.xlen(settings.keys.dead) == 0


async def test_default_handler_for_records_without_callback(settings, r):
    await produce(settings, r, ["nocb-1"], callback=None)
    seen = []
    runner = ConsumerRunner(settings, group="g", handlers={}, default_handler=lambda rec: seen.append(rec.request_id),
                            block_ms=100)
    async with running(runner):
        await wait_until(lambda: seen == ["nocb-1"], timeout=5)
    assert await group_pending(r, settings.keys.results, "g") == 0


# ---------------------------------------------------------------- dead letters


async def consume_until(settings, r, *, dead: int, applied: list[str]) -> ConsumerRunner:
    """Run a consumer whose handler ``h`` notes each request_id until ``dead`` letters are in the
    dead stream and exactly ``applied`` were applied; then stop it."""
    seen: list[str] = []
    runner = ConsumerRunner(settings, group="g", handlers={"h": lambda rec: seen.append(rec.request_id)},
                            block_ms=100)
    async with running(runner):
        await wait_until(lambda: _xlen_at_least(r, settings.keys.dead, dead), timeout=5)
        await wait_until(lambda: seen == applied, timeout=5)
    return runner


async def test_records_without_a_handler_stay_pending_for_one_that_has_it(settings, r, caplog):
    """A record naming a callback this consumer has no handler for, or none while it has no
    default handler, is neither applied nor trimmed: it stays pending in the group (counted, its
    name logged once) until a consumer with the handler takes it over (within ``max_deliveries``
    passes: see the next test). Nothing is imported."""
    mod = "tests_never_imported_mod"
    assert mod not in sys.modules
    await produce(settings, r, ["evil-1"], callback="os:system")
    await produce(settings, r, ["nope-1", "nope-2"], callback="nope")
    await produce(settings, r, ["mod-1"], callback=f"{mod}:fn")
    await produce(settings, r, ["nocb-1"], callback=None)
    await produce(settings, r, ["good-1"], callback="h")
    seen: list[str] = []
    runner = ConsumerRunner(settings, group="g", handlers={"h": lambda rec: seen.append(rec.request_id)},
                            block_ms=100, trim_interval_s=0.1)
    with caplog.at_level("WARNING", logger="redroll.consumer"):
        async with running(runner):
            await wait_until(lambda: seen == ["good-1"] and runner.stats.unhandled >= 5, timeout=5)
            await asyncio.sleep(0.3)  # (trim passes)
    assert mod not in sys.modules
    assert await r.xlen(settings.keys.dead) == 0 and runner.stats.dead_lettered == 0
    assert await group_pending(r, settings.keys.results, "g") == 5
    assert await trim_acked(r, settings.keys.results) == 0 and await r.xlen(settings.keys.results) == 6
    said = [m for m in caplog.messages if "left pending" in m]
    assert len(said) == 4 and sum("'nope'" in m for m in said) == 1  # (once per name)
    assert any("no default_handler" in m for m in said)
    # A consumer of the group with the handlers takes them over after claim_idle and applies them.
    later: list[str] = []
    fixed = ConsumerRunner(settings, group="g", handlers={"nope": lambda rec: later.append(rec.request_id)},
                           default_handler=lambda rec: later.append(rec.request_id), block_ms=100)
    async with running(fixed):
        await wait_until(lambda: sorted(later) == ["nocb-1", "nope-1", "nope-2"], timeout=10)
    assert {d["rid"] for d in await dead_entries(r, settings)} <= {b"evil-1", b"mod-1"}  # (nobody's)


async def test_a_record_no_consumer_handles_is_dead_lettered_after_max_deliveries_then_requeued(settings, r):
    """It used to be re-delivered forever (its delivery count passed 27 in 40 s with claim_idle
    1.5 s and max_deliveries 5): now each take-over counts, and past max_deliveries it is
    dead-lettered naming the callback, visible, and requeued once the handler is deployed."""
    from redroll.ops.dead import requeue

    settings = fast(settings)
    await produce(settings, r, ["evil-1"], callback="os:system")
    runner = ConsumerRunner(settings, group="g", handlers={"h": lambda rec: None}, block_ms=100)
    async with running(runner):
        await wait_until(lambda: _xlen_at_least(r, settings.keys.dead, 1), timeout=20)
    (letter,) = await dead_entries(r, settings)
    assert letter["rid"] == b"evil-1" and letter["source"].startswith(b"consumer:")
    assert int(letter["deliveries"]) == settings.max_deliveries + 1
    assert letter["reason"].decode().startswith("no handler registered under 'os:system' in group g: delivered 4 "
                                                "times (max_deliveries=3)"), letter["reason"]
    assert await group_pending(r, settings.keys.results, "g") == 0
    # Deployed: a consumer with the handler, then the dead letter requeued: applied once.
    applied: list[str] = []
    fixed = ConsumerRunner(settings, group="g", handlers={"os:system": lambda rec: applied.append(rec.request_id)},
                           block_ms=100)
    async with running(fixed):
        done, refused = await requeue(r, settings, None)
        assert len(done) == 1 and not refused
        await wait_until(lambda: applied == ["evil-1"], timeout=10)
    assert await r.xlen(settings.keys.dead) == 0


async def test_undecodable_records_are_dead_lettered_and_the_rest_applied(settings, r):
    poison = {
        "not-msgpack": b"\xc1\xff",
        "deeply-nested": b"\x81\xa9meta_info\x81\xa1k" + b"\x91" * 2_000 + b"\xc0",  # (2,000 lists deep)
        "map32-full": b"\xdf\xff\xff\xff\xff",  # (a header counting 2**32 - 1 pairs)
    }
    for rid, data in poison.items():
        await r.xadd(settings.keys.results, {"rid": rid, "status": "finished", "worker": "w", "data": data})
    await produce(settings, r, ["good-1"])
    runner = await consume_until(settings, r, dead=3, applied=["good-1"])
    reasons = {d["rid"].decode(): d["reason"].decode() for d in await dead_entries(r, settings)}
    assert set(reasons) == set(poison)
    assert reasons["deeply-nested"] == "invalid data: maps or lists nested too deeply"
    assert "msgpack" in reasons["not-msgpack"] and "msgpack" in reasons["map32-full"]
    assert runner.stats.dead_lettered == 3
    assert await group_pending(r, settings.keys.results, "g") == 0


async def test_failing_callback_retried_then_dead_lettered(settings, r):
    settings = fast(settings)
    await produce(settings, r, ["fail-1"])
    calls = []

    def boom(rec):
        calls.append(time.monotonic())
        raise RuntimeError(f"handler exploded on {rec.request_id} #{len(calls)}")

    runner = ConsumerRunner(settings, group="g", handlers={"h": boom}, block_ms=100)
    async with running(runner):
        await wait_until(lambda: _xlen_at_least(r, settings.keys.dead, 1), timeout=10)
    assert len(calls) == settings.max_deliveries
    [letter] = await dead_entries(r, settings)
    reason = letter["reason"].decode()
    assert "delivered" in reason and f"max_deliveries={settings.max_deliveries}" in reason
    assert f"handler exploded on fail-1 #{settings.max_deliveries}" in reason
    assert "RuntimeError" in reason
    assert letter["rid"] == b"fail-1" and letter["source"] == b"consumer:g"
    assert await group_pending(r, settings.keys.results, "g") == 0
    assert runner.stats.failures == settings.max_deliveries and runner.stats.applied == 0


async def test_handler_failing_once_then_succeeding_is_applied_once(settings, r):
    settings = fast(settings)
    await produce(settings, r, ["flaky-1", "fine-1"])
    attempts: Counter = Counter()
    applied: Counter = Counter()

    async def flaky(rec):
        attempts[rec.request_id] += 1
        if rec.request_id == "flaky-1" and attempts[rec.request_id] == 1:
            raise ValueError("transient")
        applied[rec.request_id] += 1

    runner = ConsumerRunner(settings, group="g", handlers={"h": flaky}, block_ms=100)
    async with running(runner):
        await wait_until(lambda: applied["flaky-1"] == 1, timeout=10)
        await asyncio.sleep(1.0)  # a few more reclaim passes: nothing is re-applied
    assert applied == Counter({"flaky-1": 1, "fine-1": 1})
    assert attempts == Counter({"flaky-1": 2, "fine-1": 1})
    assert await r.xlen(settings.keys.dead) == 0
    assert await group_pending(r, settings.keys.results, "g") == 0
    assert runner.stats.reclaimed == 1


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_handler_ending_in_cancelled_error_did_not_complete_and_is_retried(settings, r, kind):
    # (a handler that awaited something another task cancelled: CancelledError is no Exception,
    # and its entry was once acked as applied, never run to completion)
    settings = fast(settings)
    await produce(settings, r, ["cancelled-1", "fine-1"])
    attempts: Counter = Counter()
    applied: Counter = Counter()

    def apply(rec):
        attempts[rec.request_id] += 1
        if rec.request_id == "cancelled-1" and attempts[rec.request_id] == 1:
            raise asyncio.CancelledError()
        applied[rec.request_id] += 1

    async def apply_async(rec):
        await asyncio.sleep(0)
        apply(rec)

    runner = ConsumerRunner(settings, group="g", handlers={"h": apply_async if kind == "async" else apply},
                            block_ms=100)
    async with running(runner):
        await wait_until(lambda: applied["cancelled-1"] == 1, timeout=10)
    assert applied == Counter({"cancelled-1": 1, "fine-1": 1})
    assert attempts == Counter({"cancelled-1": 2, "fine-1": 1})
    assert runner.stats.failures == 1 and runner.stats.applied == 2
    assert await group_pending(r, settings.keys.results, "g") == 0


# ---------------------------------------------------------------- de-duplication


async def test_duplicate_record_applied_once_per_group(settings, r):
    entries = await produce(settings, r, ["dup-1"])
    results = settings.keys.results
    applied: Counter = Counter()
    runner = ConsumerRunner(settings, group="g", handlers={"h": lambda rec: applied.__setitem__(
        ("g", rec.request_id), applied[("g", rec.request_id)] + 1)}, block_ms=100)
    async with running(runner):
        await wait_until(lambda: applied[("g", "dup-1")] == 1, timeout=5)
        await r.xadd(results, entries[0][1])  # a replayed copy of the same record
        await wait_until(lambda: runner.stats.duplicates_skipped == 1, timeout=5)
    assert applied[("g", "dup-1")] == 1
    assert runner.stats.applied == 1
    assert await group_pending(r, results, "g") == 0

    # a second group applies it once too, although it sees both copies
    other = ConsumerRunner(settings, group="g2", handlers={"h": lambda rec: applied.__setitem__(
        ("g2", rec.request_id), applied[("g2", rec.request_id)] + 1)}, block_ms=100)
    async with running(other):
        await wait_until(lambda: other.stats.applied + other.stats.duplicates_skipped == 2, timeout=5)
    assert applied == Counter({("g", "dup-1"): 1, ("g2", "dup-1"): 1})
    assert other.stats.duplicates_skipped == 1
    assert await group_pending(r, results, "g2") == 0


@pytest.mark.parametrize("apply_bytes", [APPLY_BYTES, 1], ids=["one-chunk", "a-chunk-per-record"])
async def test_duplicates_within_one_batch_applied_once(settings, r, apply_bytes):
    entries = await produce(settings, r, ["dup-2", "other-2"])
    for _ in range(2):
        await r.xadd(settings.keys.results, entries[0][1])
    applied: Counter = Counter()
    runner = ConsumerRunner(settings, group="g", handlers={"h": lambda rec: applied.update([rec.request_id])},
                            block_ms=100, apply_bytes=apply_bytes)
    async with running(runner):
        await wait_until(lambda: runner.stats.applied + runner.stats.duplicates_skipped == 4, timeout=5)
    assert applied == Counter({"dup-2": 1, "other-2": 1})
    assert runner.stats.duplicates_skipped == 2
    assert await group_pending(r, settings.keys.results, "g") == 0


async def test_a_batch_is_applied_and_acked_chunk_by_chunk(settings, r, monkeypatch):
    # One read of 4 records, chunks of one record each: when a record's callback runs, the
    # records before it are acked already, and its own chunk is the only one decoded.
    await produce(settings, r, [f"chunk-{i}" for i in range(4)])
    results = settings.keys.results
    pending_seen: list[int] = []

    async def handler(rec):
        pending_seen.append(await group_pending(r, results, "g"))
        assert [i.record is not None for i in held] in ([], [True])

    held: list = []
    runner = ConsumerRunner(settings, group="g", handlers={"h": handler}, block_ms=100, apply_bytes=1)
    apply_chunk = BatchApplier._apply_chunk

    async def watched(self, items, stream, checked):
        held[:] = items
        await apply_chunk(self, items, stream, checked)

    monkeypatch.setattr(BatchApplier, "_apply_chunk", watched)
    async with running(runner):
        await wait_until(lambda: runner.stats.applied == 4, timeout=5)
    assert pending_seen == [4, 3, 2, 1]
    assert await group_pending(r, results, "g") == 0


async def test_reads_of_large_records_ask_for_fewer_entries(settings, r, monkeypatch):
    await produce(settings, r, [f"big-{i}" for i in range(6)])
    size = len((await r.xrange(settings.keys.results, count=1))[0][1][b"data"])
    counts: list[int] = []
    read = runner_module.read_group

    async def counting(*args, **kwargs):
        counts.append(kwargs["count"])
        return await read(*args, **kwargs)

    monkeypatch.setattr(runner_module, "read_group", counting)
    # a budget of two and a half records of this size: the first read asks for a full batch (and
    # gets all 6), the next ones for 2
    runner = ConsumerRunner(settings, group="g", handlers={"h": lambda rec: None}, block_ms=50, batch=64,
                            apply_bytes=2 * size + size // 2, redis_client=r)
    async with running(runner):
        await wait_until(lambda: runner.stats.applied == 6 and len(counts) >= 2, timeout=5)
    assert counts[0] == 64 and set(counts[1:]) == {2}


def _log_reads_and_checks(monkeypatch, events: list[str]) -> None:
    read, check = runner_module.read_group, BatchApplier._applied_already

    async def logged_read(*args, **kwargs):
        events.append("read")
        return await read(*args, **kwargs)

    async def logged_check(self, *args):
        events.append("check")
        return await check(self, *args)

    monkeypatch.setattr(runner_module, "read_group", logged_read)
    monkeypatch.setattr(BatchApplier, "_applied_already", logged_check)


async def test_the_next_read_is_asked_for_after_the_markers_check_and_before_the_callbacks(settings, r, monkeypatch):
    """The next read goes out once a batch's markers are checked, not beside the check (whose reply
    every callback waits for), and is out while the batch's async callbacks run."""
    await produce(settings, r, [f"pre-{i}" for i in range(4)])
    events: list[str] = []
    _log_reads_and_checks(monkeypatch, events)

    async def h(rec):
        events.append(rec.request_id)

    runner = ConsumerRunner(settings, group="g", handlers={"h": h}, block_ms=50, batch=2, redis_client=r)
    async with running(runner):
        await wait_until(lambda: runner.stats.applied == 4, timeout=5)
    assert events[:9] == ["read", "check", "read", "pre-0", "pre-1", "check", "read", "pre-2", "pre-3"]
    assert await group_pending(r, settings.keys.results, "g") == 0


async def test_with_sync_callbacks_the_next_read_goes_out_while_the_batch_is_acked(settings, r, monkeypatch):
    """Sync callbacks run without a wait between them: the next read, asked for after the check,
    goes out at the first wait after them, the acks' round trip."""
    await produce(settings, r, [f"pre-{i}" for i in range(4)])
    events: list[str] = []
    _log_reads_and_checks(monkeypatch, events)
    ack = BatchApplier._ack

    async def logged_ack(self, *args):
        events.append("ack")
        return await ack(self, *args)

    monkeypatch.setattr(BatchApplier, "_ack", logged_ack)
    runner = ConsumerRunner(settings, group="g", handlers={"h": lambda rec: events.append(rec.request_id)},
                            block_ms=50, batch=2, redis_client=r)
    async with running(runner):
        await wait_until(lambda: runner.stats.applied == 4, timeout=5)
    assert events[:11] == ["read", "check", "pre-0", "pre-1", "ack", "read", "check", "pre-2", "pre-3", "ack", "read"]
    assert await group_pending(r, settings.keys.results, "g") == 0


async def test_what_the_read_out_at_a_stop_delivers_is_applied(settings, r):
    """A stop while a batch is applied: the read already asked for is awaited and what it brings is
    applied and acked before the runner ends (nothing is left pending for claim_idle)."""
    await produce(settings, r, ["first"])
    entered, release = asyncio.Event(), asyncio.Event()
    applied: list[str] = []

    async def h(rec):
        applied.append(rec.request_id)
        if rec.request_id == "first":
            entered.set()
            await release.wait()

    runner = ConsumerRunner(settings, group="g", handlers={"h": h}, block_ms=2000, redis_client=r)
    task = asyncio.create_task(runner.run())
    await asyncio.wait_for(entered.wait(), 5)
    await asyncio.sleep(0.1)  # the next read is out, blocked on the empty stream
    runner.request_stop()
    await produce(settings, r, ["late"])  # it arrives after the stop: that read delivers it
    release.set()
    await asyncio.wait_for(task, 10)
    assert applied == ["first", "late"]
    assert runner.stats.applied == 2
    assert await group_pending(r, settings.keys.results, "g") == 0


# ---------------------------------------------------------------- recovery and sharing


async def test_reclaims_pending_entries_of_dead_consumer(settings, r):
    settings = fast(settings, claim_idle_ms=500)
    rids = [f"orphan-{i}" for i in range(5)]
    await produce(settings, r, rids)
    results = settings.keys.results
    await r.xgroup_create(results, "g", id="0")
    got = await r.xreadgroup("g", "consumer-A-dead", {results: ">"}, count=100)
    assert len(got[0][1]) == 5
    assert await group_pending(r, results, "g") == 5
    applied: Counter = Counter()
    runner = ConsumerRunner(settings, group="g", name="consumer-B", handlers={"h": lambda rec: applied.update(
        [rec.request_id])}, block_ms=100)
    t0 = time.monotonic()
    await run_until_drained(runner, timeout=30)  # (what a dead consumer holds is not done: taken over)
    assert time.monotonic() - t0 >= 0.4  # not before claim_idle
    assert applied == Counter({x: 1 for x in rids})
    assert runner.stats.reclaimed == 5
    assert await group_pending(r, results, "g") == 0
    consumers = {c["name"].decode(): c for c in await r.xinfo_consumers(results, "g")}
    assert consumers["consumer-A-dead"]["pending"] == 0


async def test_two_runners_share_the_work(settings, r):
    rids = [f"share-{i}" for i in range(60)]
    applied: Counter = Counter()
    by_runner: Counter = Counter()

    def make(tag):
        async def h(rec):
            await asyncio.sleep(0.005)
            applied[rec.request_id] += 1
            by_runner[tag] += 1
        return h

    a = ConsumerRunner(settings, group="g", handlers={"h": make("a")}, block_ms=100, batch=5)
    b = ConsumerRunner(settings, group="g", handlers={"h": make("b")}, block_ms=100, batch=5)
    async with running(a), running(b):
        await asyncio.sleep(0.2)  # both are blocked on XREADGROUP before the records arrive
        await produce(settings, r, rids)
        await wait_until(lambda: sum(applied.values()) >= 60, timeout=10)
        await asyncio.sleep(0.3)
    assert applied == Counter({x: 1 for x in rids})
    assert by_runner["a"] > 0 and by_runner["b"] > 0
    assert await group_pending(r, settings.keys.results, "g") == 0


# ---------------------------------------------------------------- trimming


async def test_trim_only_what_every_group_acked(settings, r):
    results = settings.keys.results
    assert await trim_acked(r, results) == 0  # no stream yet
    await produce(settings, r, [f"trim-{i}" for i in range(8)])
    await r.xgroup_create(results, "late", id="0")  # a group that has not read anything yet
    applied = []
    runner = ConsumerRunner(settings, group="g", handlers={"h": lambda rec: applied.append(rec.request_id)},
                            block_ms=100)
    await run_until_drained(runner, timeout=30)
    assert len(applied) == 8 and await _pending_is(r, results, "g", 0)
    assert await trim_acked(r, results) == 0
    assert await r.xlen(results) == 8

    # the late group reads everything and acks the first 5; 3 stay pending
    got = await r.xreadgroup("late", "late-1", {results: ">"}, count=100)
    ids = [i for i, _f in got[0][1]]
    await r.xack(results, "late", *ids[:5])
    assert await trim_acked(r, results) == 5
    remaining = [i for i, _f in await r.xrange(results)]
    assert remaining == ids[5:]
    await r.xack(results, "late", *ids[5:])
    assert await trim_acked(r, results) == 3
    assert await r.xlen(results) == 0

    # new records after a full trim: an unread one is kept
    await produce(settings, r, ["trim-new"])
    assert await trim_acked(r, results) == 0
    assert await r.xlen(results) == 1


async def _pending_is(r, stream, group, n):
    return await group_pending(r, stream, group) == n


# ---------------------------------------------------------------- the CLI process


async def test_consume_subprocess_applies_and_stops_on_sigterm(settings, r, tmp_path):
    rids = [f"cli-{i}" for i in range(6)]
    await produce(settings, r, rids)
    applied_file = tmp_path / "applied.jsonl"
    log = tmp_path / "consume.log"
    proc = spawn(settings, "consume", "--group", "g", "--handler", "h=tests.handlers:append_to_file",
                 log=log, REDROLL_TEST_APPLIED=str(applied_file))
    try:
        def lines():
            return applied_file.read_text().splitlines() if applied_file.exists() else []

        await wait_until(lambda: len(lines()) >= 6, timeout=15)
        await wait_until(lambda: _pending_is(r, settings.keys.results, "g", 0), timeout=5)
        rows = [json.loads(x) for x in lines()]
        assert sorted(x["request_id"] for x in rows) == sorted(rids)
        assert all(x["status"] == "finished" and x["pid"] == proc.pid for x in rows)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert proc.returncode == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
