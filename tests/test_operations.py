"""Operating a fleet: status figures, dead-letter tools, metrics, plain fields, housekeeping, KEDA."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.request

import msgpack
import pytest

from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.observability.logs import JsonFormatter
from redroll.ops import dead
from redroll.ops.control import send_abort
from redroll.ops.gc import collect_garbage
from redroll.ops.status import collect_status
from redroll.producer import Producer
from redroll.producer.client import make_request, send
from redroll.shared.keys import WORKERS_GROUP
from redroll.shared.types import RecordStatus
from redroll.testing.embedded import free_port
from tests.conftest import ROOT, wait_until
from tests.support.raw_submit import add_request_entry


async def _xlen_is(r, key, n):
    return await r.xlen(key) == n


async def _pending_is(r, settings, n):
    return int((await r.xpending(settings.keys.requests, WORKERS_GROUP))["pending"]) == n


async def _beat_inflight(r, keys, name, n):
    raw = await r.hget(keys.workers, name)
    return raw is not None and json.loads(raw)["inflight"] == n


async def test_status_reports_known_states_exactly(settings, r):
    keys = settings.keys
    # Two dead letters, two in flight on one worker (max_inflight=2, slow), three queued, a stale worker.
    await r.xadd(keys.requests, {"rid": "bad-1", "data": b"\xc1"})
    await r.xadd(keys.requests, {"rid": "bad-2", "data": msgpack.packb({"v": 1})})
    await send(settings, r, [make_request(request_id=f"slow-{i}", prompt="x", sampling_params={"max_new_tokens": 1000})
                             for i in range(2)])
    worker = Worker(settings, SyntheticEngine(token_ms=50), max_inflight=2, block_ms=200)
    task = asyncio.create_task(worker.run())
    await wait_until(lambda: _xlen_is(r, keys.dead, 2))
    await wait_until(lambda: _pending_is(r, settings, 2))
    await send(settings, r, [make_request(request_id=f"queued-{i}", prompt="y") for i in range(3)])
    await r.hset(keys.workers, "worker-gone-1", json.dumps({"engine": "synthetic", "seen": time.time() - 120}))
    await wait_until(lambda: _beat_inflight(r, keys, worker.name, 2))
    try:
        status = await collect_status(r, keys)
    finally:
        await send_abort(r, keys, ["slow-0", "slow-1"])
        worker.request_stop()
        await task
    req = status["requests"]
    assert req["length"] == 5 and req["pending"] == 2 and req["backlog"] == 3
    assert req["pending_per_consumer"] == {worker.name: 2}
    assert req["delivery_histogram"] == {"1": 2}
    assert req["oldest_pending_idle_ms"] is not None and req["oldest_pending_age_ms"] >= req["oldest_pending_idle_ms"] - 50
    assert status["dead_letters"] == 2
    assert status["workers_alive"] == 1 and status["workers_stale"] == 1
    by_name = {w["name"]: w for w in status["workers"]}
    assert by_name[worker.name]["inflight"] == 2 and by_name[worker.name]["alive"]
    assert not by_name["worker-gone-1"]["alive"]
    assert set(status["rates_1m"]) == {"requests_per_s", "tokens_per_s"}


async def test_dead_requeue_fixed_and_still_invalid(settings, r):
    keys = settings.keys
    worker = Worker(settings, SyntheticEngine(), block_ms=200)
    task = asyncio.create_task(worker.run())
    async with Producer(settings) as p:
        bad = {"v": 1, "request_id": "fix-me", "prompt": "x", "submitted_at": time.time(), "reply_to": p.reply_to,
               "sampling_params": {"temperature": -1.0, "max_new_tokens": 4}}
        await add_request_entry(r, keys.requests, {"rid": "fix-me", "reply_to": p.reply_to, "data": msgpack.packb(bad)},
                                owner_key=keys.owner(p.name), rid="fix-me")  # (noted as p's own submit would)
        first = await p.result("fix-me", timeout=10)
        assert first.status is RecordStatus.ERROR and "temperature" in first.error
        entries = await dead.list_dead(r, keys, reason="temperature")
        assert len(entries) == 1 and entries[0].request_id == "fix-me" and entries[0].source == "worker"
        # Unchanged, it is still invalid: refused with the reason, left in place.
        done, refused = await dead.requeue(r, settings, [entries[0].id])
        assert done == [] and "temperature" in refused[0] and await r.xlen(keys.dead) == 1
        # Fixed on requeue: it completes.
        done, refused = await dead.requeue(r, settings, [entries[0].id],
                                           patches={"sampling_params.temperature": 0.7})
        assert done == [entries[0].id] and refused == [] and await r.xlen(keys.dead) == 0
        fixed = await p.result("fix-me", timeout=10, fresh=True)
    worker.request_stop()
    await task
    assert fixed.status is RecordStatus.FINISHED and len(fixed.output_token_ids[0]) == 4


async def test_a_requeued_request_is_a_new_attempt_for_consumer_groups(settings, r):
    """A group that applied the error record of a dead-lettered request applies the record of
    its requeue too (each requeue is its own attempt: ``requeued`` in the record)."""
    from redroll.consumer.runner import ConsumerRunner
    from tests.conftest import running

    keys = settings.keys
    seen: list[tuple[str, str, int]] = []
    worker = Worker(settings, SyntheticEngine(), block_ms=200)
    consumer = ConsumerRunner(settings, group="trainer", block_ms=200,
                              handlers={"h": lambda rec: seen.append((rec.request_id, rec.status.value,
                                                                      rec.requeued))})
    async with running(worker, consumer):
        bad = {"v": 1, "request_id": "redo-me", "prompt": "x", "submitted_at": time.time(), "callback": "h",
               "sampling_params": {"temperature": -1.0, "max_new_tokens": 4}}
        await r.xadd(keys.requests, {"rid": "redo-me", "data": msgpack.packb(bad)})
        await wait_until(lambda: len(seen) == 1)
        (entry,) = await dead.list_dead(r, keys)
        done, refused = await dead.requeue(r, settings, [entry.id], patches={"sampling_params.temperature": 0.7})
        assert done == [entry.id] and refused == []
        await wait_until(lambda: len(seen) == 2)
        await asyncio.sleep(0.5)
    assert seen == [("redo-me", "error", 0), ("redo-me", "finished", 1)]
    assert consumer.stats.duplicates_skipped == 0


async def test_dead_cli_list_requeue_purge(settings, r):
    from tests.test_cli import run_cli

    keys = settings.keys
    await r.xadd(keys.dead, {"reason": "invalid data: not valid msgpack", "source": "worker", "entry": "1-0",
                             "deliveries": "1", "rid": "x1", "data": b"\xc1"})
    listed = json.loads(run_cli(settings, "dead", "list", "--json").stdout)
    assert [e["request_id"] for e in listed] == ["x1"] and "msgpack" in listed[0]["reason"]
    human = run_cli(settings, "dead", "list")
    assert human.returncode == 0 and "x1" in human.stdout
    proc = run_cli(settings, "dead", "requeue", "--all")
    assert proc.returncode == 3 and "still invalid" in proc.stderr
    proc = run_cli(settings, "dead", "purge", "--all")
    assert proc.returncode == 0 and "purged 1" in proc.stdout and await r.xlen(keys.dead) == 0


async def test_metrics_endpoint_serves_documented_names(settings, r):
    pytest.importorskip("prometheus_client")
    from redroll.consumer.runner import ConsumerRunner
    from redroll.observability.metrics import ConsumerMetrics, WorkerMetrics, serve

    worker = Worker(settings, SyntheticEngine(), block_ms=200)
    worker.metrics = WorkerMetrics(worker)
    wport = free_port()
    wserver = serve(worker.metrics, wport, addr="127.0.0.1")
    runner = ConsumerRunner(settings, group="m", handlers={"h": lambda rec: None}, block_ms=200)
    runner.metrics = ConsumerMetrics(runner)
    cport = free_port()
    cserver = serve(runner.metrics, cport, addr="127.0.0.1")
    tasks = [asyncio.create_task(worker.run()), asyncio.create_task(runner.run())]
    try:
        await send(settings, r, [make_request(prompt="x", callback="h", sampling_params={"max_new_tokens": 3})
                                 for _ in range(5)])
        await wait_until(lambda: runner.stats.applied == 5)
        wtext = urllib.request.urlopen(f"http://127.0.0.1:{wport}/metrics", timeout=5).read().decode()
        ctext = urllib.request.urlopen(f"http://127.0.0.1:{cport}/metrics", timeout=5).read().decode()
    finally:
        worker.request_stop()
        runner.request_stop()
        await asyncio.gather(*tasks)
        wserver.shutdown()
        cserver.shutdown()
    documented = (ROOT / "redroll" / "observability" / "metrics.py").read_text()
    for name in ("redroll_worker_requests_total", "redroll_worker_inflight", "redroll_worker_queue_wait_seconds",
                 "redroll_worker_engine_seconds", "redroll_worker_tokens_generated_total",
                 "redroll_worker_claims_total", "redroll_worker_lease_losses_total",
                 "redroll_worker_dead_letters_total", "redroll_worker_engine_errors_total",
                 "redroll_worker_weight_version_info"):
        assert name in wtext, name
        assert name in documented and name in (ROOT / "docs" / "operations.md").read_text()  # the metrics table
    assert 'redroll_worker_requests_total{outcome="finished"} 5.0' in wtext
    assert "redroll_worker_tokens_generated_total 15.0" in wtext
    assert "redroll_worker_engine_seconds_count 5.0" in wtext
    for name in ("redroll_consumer_callbacks_total", "redroll_consumer_dead_letters_total",
                 "redroll_consumer_reclaimed_total", "redroll_consumer_trimmed_total",
                 "redroll_consumer_callback_seconds"):
        assert name in ctext, name
        assert name in documented and name in (ROOT / "docs" / "operations.md").read_text()  # the metrics table
    assert 'redroll_consumer_callbacks_total{outcome="applied"} 5.0' in ctext


async def test_every_entry_has_its_plain_fields(settings, r):
    """What redis-cli users rely on: plain fields on every kind of entry, msgpack only in `data`."""
    keys = settings.keys
    async with Producer(settings) as p:
        await p.submit(request_id="plain-1", prompt="x", sampling_params={"max_new_tokens": 2})
        await send(settings, r, [make_request(request_id="plain-2", prompt="y", sampling_params={"max_new_tokens": 2})])
        await r.xadd(keys.requests, {"rid": "plain-bad", "data": b"\xc1"})
        await p.abort(["nothing-here"])
        req_entries = await r.xrange(keys.requests)
        assert [set(f) for _, f in req_entries[:2]] == [{b"rid", b"reply_to", b"data"}] * 2
        worker = Worker(settings, SyntheticEngine(), block_ms=200)
        task = asyncio.create_task(worker.run())
        await p.result("plain-1", timeout=10)
        # plain-2's record, and the error record of plain-bad (no reply_to: the default stream).
        await wait_until(lambda: _xlen_is(r, keys.results, 2))
        worker.request_stop()
        await task
    results = {f[b"rid"]: f for _, f in await r.xrange(keys.results)}
    assert all(set(f) == {b"rid", b"status", b"worker", b"data"} for f in results.values())
    assert results[b"plain-2"][b"status"] == b"finished" and results[b"plain-bad"][b"status"] == b"error"
    assert results[b"plain-2"][b"worker"] == worker.name.encode()
    (_, letter), = await r.xrange(keys.dead)
    assert {b"reason", b"source", b"entry", b"deliveries", b"rid", b"data"} <= set(letter)
    (_, control), = await r.xrange(keys.control)
    assert {b"kind", b"target", b"data"} == set(control) and control[b"kind"] == b"abort"


async def test_gc_removes_orphans_and_keeps_live_state(settings, r):
    keys = settings.keys
    # An orphan reply stream: no TTL, last entry long ago, nobody reading it.
    await r.xadd(keys.reply("gone-producer"), {"rid": "x"}, id="1000-0")
    # A live producer's reply stream keeps its TTL.
    async with Producer(settings, name="alive-producer"):
        await r.hset(keys.workers, mapping={"w-old": json.dumps({"seen": time.time() - 7200}),
                                            "w-new": json.dumps({"seen": time.time()})})
        await r.xgroup_create(keys.requests, WORKERS_GROUP, id="0", mkstream=True)
        await r.xgroup_createconsumer(keys.requests, WORKERS_GROUP, "empty-consumer")
        await r.xadd(keys.requests, {"rid": "held", "data": b"x"})
        await r.xreadgroup(WORKERS_GROUP, "holding-consumer", {keys.requests: ">"}, count=1)
        for name in ("empty-consumer", "holding-consumer"):  # (their checkpoint parts streams)
            await r.xadd(keys.parts(name), {"1-0 held 0 1": b"part"})
        report = await collect_garbage(r, keys, reply_ttl_s=60, stale_worker_s=3600, idle_consumer_s=0)
        assert report.reply_streams == [keys.reply("gone-producer")]
        assert report.heartbeats == ["w-old"]
        assert report.consumers == ["empty-consumer"]  # never the one holding a pending entry
        assert await r.exists(keys.reply("alive-producer"))
        assert not await r.exists(keys.reply("gone-producer"))
        names = {c["name"] for c in await r.xinfo_consumers(keys.requests, WORKERS_GROUP)}
        assert names == {b"holding-consumer"}
        # A dropped consumer's parts stream goes with it; the holder's stays.
        assert not await r.exists(keys.parts("empty-consumer")) and await r.exists(keys.parts("holding-consumer"))


def test_json_logs_name_the_request():
    record = logging.LogRecord("redroll.worker", logging.WARNING, __file__, 1, "request %s failed", ("r-1",), None)
    record.request_id = "r-1"
    record.entry_id = "1-0"
    out = json.loads(JsonFormatter().format(record))
    assert out["request_id"] == "r-1" and out["entry_id"] == "1-0" and out["msg"] == "request r-1 failed"
    assert out["level"] == "warning" and out["logger"] == "redroll.worker"
