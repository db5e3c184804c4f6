"""Affinity lanes (real redis-server): placement, agreement on L, ownership, stealing, kills, drain, abort.

With ``affinity_lanes`` L > 0 a request with an affinity key (or a group id) queues on lane
``lane_index(key, L)``; each lane is owned by one claiming worker; an entry that waits longer
than ``steal_after_ms`` in a lane is taken by any worker. The delivery promises are unchanged.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import time
from pathlib import Path

import pytest

from redroll.consumer.runner import ConsumerRunner
from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.lanes import (
    WATCHERS,
    LaneTable,
    claiming_workers,
    has_room,
    lane_plan,
    lane_scores,
)
from redroll.engine_worker.worker import Worker
from redroll.ops.status import collect_pipeline_status
from redroll.producer import Producer
from redroll.producer.client import make_request, send
from redroll.shared.keys import Keys, lane_index, partition_index
from redroll.shared.lanes import LanesMismatchError, lane_report, set_lanes
from redroll.shared.types import RecordStatus
from tests.conftest import running, spawn, stop_process, wait_until

SP = {"max_new_tokens": 4}
L = 4


def lanes_settings(settings, **kw):
    return settings.with_(affinity_lanes=L, **kw)


def key_on_lane(lane: int, lanes: int = L, prefix: str = "k") -> str:
    return next(f"{prefix}{i}" for i in range(10_000) if lane_index(f"{prefix}{i}", lanes) == lane)


async def entries(r, stream: str) -> list[dict]:
    return [{k.decode(): v.decode() for k, v in f.items() if k in (b"rid", b"ak")} for _, f in await r.xrange(stream)]


def test_lanes_are_independent_of_partitions_and_stable():
    keys = [f"session-{i}" for i in range(4000)]
    for partitions, lanes in ((1, 4), (2, 4), (4, 4), (3, 6)):
        used = collections.defaultdict(set)
        for k in keys:
            used[partition_index(k, partitions)].add(lane_index(k, lanes))
        assert all(used[p] == set(range(lanes)) for p in range(partitions)), (partitions, lanes)
    assert lane_index("session-7", 8) == lane_index("session-7", 8)
    assert Keys("ns", lanes=2).request_streams == ["{ns}:requests:high", "{ns}:requests:lane:0",
                                                   "{ns}:requests:lane:1", "{ns}:requests"]
    assert Keys("ns").request_streams == ["{ns}:requests:high", "{ns}:requests"]


def test_lane_owners_are_capped_and_move_little():
    owners, _ = lane_plan(["a", "b", "c"], 8)
    assert max(collections.Counter(owners).values()) <= 3 and set(owners) == {"a", "b", "c"}
    assert lane_plan(["c", "a", "b"], 8)[0] == owners  # the same on every worker
    after, _ = lane_plan(["a", "b"], 8)  # c died: only what c held (and the cap) moves
    assert sum(x != y for x, y in zip(owners, after)) <= 5
    assert lane_plan([], 3)[0] == [None, None, None]


def test_each_lane_has_watchers_besides_its_owner():
    names = [f"w{i}" for i in range(8)]
    owners, watchers = lane_plan(names, 32)
    for owner, watching in zip(owners, watchers):
        assert len(watching) == WATCHERS and len(set(watching)) == WATCHERS and owner not in watching
    assert lane_plan(list(reversed(names)), 32) == (owners, watchers)  # the same on every worker
    kept = {n: lane_scores(n, 32) for n in names}
    assert lane_plan(names, 32, scores=kept.__getitem__) == (owners, watchers)
    # In a fleet no larger than WATCHERS + 1, every other worker watches every lane.
    owners, watchers = lane_plan(["a", "b"], 4)
    assert all(w == [{"a": "b", "b": "a"}[o]] for o, w in zip(owners, watchers))
    assert lane_plan([], 2) == ([None, None], [[], []])


def test_a_beat_has_room_only_when_it_says_so():
    assert has_room({"inflight": 3, "max_inflight": 8})
    assert not has_room({"inflight": 8, "max_inflight": 8})
    assert not has_room({"state": "running"}) and not has_room(None) and not has_room({"inflight": "x"})


async def test_steal_scans_look_at_busy_owners_lanes_and_at_watched_ones(settings, r):
    """A worker scans every lane of an owner that had no free slot (or did not say) at its last
    beat, and of the lanes of owners with room only those it watches."""
    from types import SimpleNamespace

    s = settings.with_(affinity_lanes=64)
    now = time.time()
    beats = {"me": {"state": "running", "seen": now},
             "busy": {"state": "running", "seen": now, "inflight": 8, "max_inflight": 8},
             "quiet": {"state": "running", "seen": now}}
    beats.update({f"idle{i}": {"state": "running", "seen": now, "inflight": 0, "max_inflight": 8} for i in range(5)})
    await r.hset(s.keys.workers, mapping={k: json.dumps(v) for k, v in beats.items()})
    table = LaneTable(SimpleNamespace(settings=s, redis=r, keys=s.keys, name="me", metrics=None))
    assert table.scanned == list(range(64))  # before its first refresh: every lane
    await table.refresh("running")
    owners, watchers = lane_plan(beats, 64)
    assert table.owners == owners
    expected = [j for j, o in enumerate(owners) if o in ("busy", "quiet") or (o != "me" and "me" in watchers[j])]
    assert table.scanned == expected
    assert {owners[j] for j in expected} >= {"busy", "quiet"}
    assert len(expected) < 64 - len(table.owned)  # not every idle owner's lane
    # Reclaim passes: the lanes it owns or watches, between the high-priority and the shared stream.
    reclaimed = [j for j, o in enumerate(owners) if o == "me" or "me" in watchers[j]]
    assert table.reclaimed == reclaimed and 0 < len(reclaimed) < 64
    table.ctx.parts, table.ctx.request_streams = [s.keys], s.keys.request_streams
    assert table.reclaim_streams() == [s.keys.requests_high, *(s.keys.lane(j) for j in reclaimed), s.keys.requests]
    # The scores it keeps are those of the workers claiming now.
    assert set(table._scores) == set(beats)
    await r.hdel(s.keys.workers, "busy")
    await table.refresh("running")
    assert set(table._scores) == set(beats) - {"busy"}


async def test_placement_by_key_group_and_priority(settings, r):
    s = lanes_settings(settings)
    async with Producer(s) as p:
        await p.submit(request_id="plain", prompt="x", sampling_params=SP)
        await p.submit(request_id="turn-0", prompt="x", sampling_params=SP, affinity_key="sess-1")
        await p.submit_group(3, group_id="grp-1", prompt="x", sampling_params=SP)
        await p.submit(request_id="urgent", prompt="x", sampling_params=SP, affinity_key="sess-1", priority=1)
    keys = s.keys
    assert [e["rid"] for e in await entries(r, keys.requests)] == ["plain"]
    assert [e["rid"] for e in await entries(r, keys.requests_high)] == ["urgent"]
    sess = await entries(r, keys.lane(lane_index("sess-1", L)))
    grp = await entries(r, keys.lane(lane_index("grp-1", L)))
    assert {"rid": "turn-0", "ak": "sess-1"} in sess
    assert [e["rid"] for e in grp if e["rid"].startswith("grp-1")] == ["grp-1_000", "grp-1_001", "grp-1_002"]
    assert all(e["ak"] == "grp-1" for e in grp if e["rid"].startswith("grp-1"))
    assert await r.hget(keys.config, "affinity_lanes") == b"4"


async def test_lanes_off_is_the_plain_layout(settings, r):
    async with Producer(settings) as p:
        await p.submit_group(2, group_id="grp-0", prompt="x", sampling_params=SP)
        await p.submit(request_id="s", prompt="x", sampling_params=SP, affinity_key="sess")
    assert [e["rid"] for e in await entries(r, settings.keys.requests)] == ["grp-0_000", "grp-0_001", "s"]
    assert not await r.exists(settings.keys.config)
    assert [k async for k in r.scan_iter(match=f"{{{settings.namespace}}}:requests:lane:*")] == []


async def test_every_process_agrees_on_l(settings, r):
    async with Producer(lanes_settings(settings)):
        pass
    with pytest.raises(LanesMismatchError, match="affinity_lanes=4"):
        async with Producer(settings.with_(affinity_lanes=2)):
            pass
    with pytest.raises(LanesMismatchError, match="affinity_lanes=4"):
        await Worker(settings, SyntheticEngine(), block_ms=100).run()
    # Changing L is refused while a lane holds an entry, then allowed.
    async with Producer(lanes_settings(settings)) as p:
        await p.submit(request_id="q", prompt="x", sampling_params=SP, affinity_key="a")
    with pytest.raises(ValueError, match="still hold entries"):
        await set_lanes(r, settings.keys, settings.partition_keys, 2)
    await r.delete(settings.keys.lane(lane_index("a", L)))
    assert await set_lanes(r, settings.keys, settings.partition_keys, 2) == 4
    assert await r.hget(settings.keys.config, "affinity_lanes") == b"2"


async def test_two_workers_split_the_lanes_and_keep_groups_together(settings, r):
    s = lanes_settings(settings)
    workers = [Worker(s, SyntheticEngine(token_ms=1), max_inflight=8, block_ms=100, name=f"w{i}") for i in range(2)]
    async with running(*workers), Producer(s) as p:
        await wait_until(lambda: all(len(w.lanes.owned) == 2 for w in workers), 10)
        assert sorted(workers[0].lanes.owned + workers[1].lanes.owned) == list(range(L))
        async def reported() -> bool:
            report = await lane_report(r, s.keys, s.partition_keys)
            return report["lanes"] == L and all(x["owner"] in ("w0", "w1") for x in report["per_lane"])
        await wait_until(reported, 5)
        await asyncio.sleep(0.3)  # blocking reads issued before the last ownership change have returned
        groups = [await p.submit_group(4, group_id=f"g{i}", prompt=f"prompt {i}", sampling_params=SP)
                  for i in range(16)]
        records = [await asyncio.wait_for(g.wait(), 20) for g in groups]
        owned = {w.name: w.lanes.owned for w in workers}
    for group_id, recs in zip((g.group_id for g in groups), records):
        ran_on = {rec.meta_info["worker"] for rec in recs}
        owner = next(name for name, lanes in owned.items() if lane_index(group_id, L) in lanes)
        assert ran_on == {owner}, (group_id, [w.stats.claims_by_kind for w in workers])
    assert sum(w.stats.claims_by_kind.get("stolen", 0) for w in workers) == 0


async def beat_forever(r, keys, name: str, stop: asyncio.Event, **extra) -> None:
    """A worker that says it is claiming and never claims (hung, or its loop is stuck)."""
    while not stop.is_set():
        await r.hset(keys.workers, name, json.dumps({"state": "running", "seen": time.time(), "pid": 0, **extra}))
        await asyncio.sleep(0.2)


@pytest.mark.parametrize("ghost_beat", [{}, {"inflight": 0, "max_inflight": 8}], ids=["says-nothing", "says-it-has-room"])
async def test_entries_on_a_silent_owners_lanes_are_stolen_after_the_wait(settings, r, ghost_beat):
    # A beat that says the owner has room leaves its lanes to their watchers (here the only other worker).
    s = lanes_settings(settings, steal_after_ms=400)
    worker = Worker(s, SyntheticEngine(token_ms=1), max_inflight=8, block_ms=100, name="real")
    stop = asyncio.Event()
    ghost = asyncio.create_task(beat_forever(r, s.keys, "ghost", stop, **ghost_beat))
    try:
        async with running(worker), Producer(s) as p:
            await wait_until(lambda: len(worker.lanes.owned) == 2, 10)
            theirs = [j for j in range(L) if j not in worker.lanes.owned]
            mine = worker.lanes.owned
            sent = time.monotonic()
            stolen = await p.submit_many([dict(request_id=f"s{j}", prompt="x", sampling_params=SP,
                                               affinity_key=key_on_lane(j)) for j in theirs])
            own = await p.submit_many([dict(request_id=f"o{j}", prompt="x", sampling_params=SP,
                                            affinity_key=key_on_lane(j)) for j in mine])
            own_records = [await asyncio.wait_for(f, 10) for f in own]
            stolen_records = [await asyncio.wait_for(f, 10) for f in stolen]
            waited = time.monotonic() - sent
    finally:
        stop.set()
        await ghost
    assert all(x.status is RecordStatus.FINISHED for x in own_records + stolen_records)
    assert all(x.meta_info["queue_ms"] < 400 for x in own_records)
    assert all(x.meta_info["queue_ms"] >= 400 for x in stolen_records) and waited < 3.0
    assert worker.stats.claims_by_kind["stolen"] == len(theirs)


def test_only_fresh_claiming_workers_own_lanes():
    now = 1000.0
    beats = {"run": {"state": "running", "seen": now}, "stale": {"state": "running", "seen": now - 5},
             "paused": {"state": "paused", "seen": now}, "draining": {"state": "draining", "seen": now},
             "blocked": {"state": "blocked", "seen": now}, "waiting": {"state": "weights-waiting", "seen": now}}
    assert claiming_workers(beats, now, stale_after_s=1.5) == ["run"]


async def test_abort_of_a_request_queued_on_a_lane(settings, r):
    s = lanes_settings(settings)
    async with Producer(s) as p:
        future = await p.submit(request_id="to-abort", prompt="x", sampling_params=SP, affinity_key="sess-9")
        assert await p.abort(["to-abort"]) == ["to-abort"]
        record = await asyncio.wait_for(future, 10)
    assert record.status is RecordStatus.ABORTED and record.finish_reasons == [None]
    assert await r.xlen(s.keys.lane(lane_index("sess-9", L))) == 0


async def test_drain_with_lanes_loses_nothing(settings, r):
    s = lanes_settings(settings)
    applied: collections.Counter = collections.Counter()
    consumer = ConsumerRunner(s, group="g", handlers={"h": lambda rec: applied.update([rec.request_id])},
                              block_ms=100)
    a = Worker(s, SyntheticEngine(token_ms=20), max_inflight=4, block_ms=100, name="a")
    b = Worker(s, SyntheticEngine(token_ms=2), max_inflight=8, block_ms=100, name="b")
    async with running(b, consumer):
        task = asyncio.create_task(a.run())
        await wait_until(lambda: a.lanes is not None and len(a.lanes.owned) == 2 and len(b.lanes.owned) == 2, 10)
        await send(s, r, [make_request(request_id=f"d{i}", prompt="x", sampling_params={"max_new_tokens": 8},
                                       callback="h", affinity_key=f"sess-{i % 8}") for i in range(48)])
        await wait_until(lambda: a.stats.claimed >= 2, 10)
        a.request_stop()
        await asyncio.wait_for(task, 30)
        await wait_until(lambda: sum(applied.values()) == 48, 30)
    assert applied == collections.Counter({f"d{i}": 1 for i in range(48)})
    for stream in s.keys.request_streams:
        assert await r.xlen(stream) == 0


@pytest.mark.slow
async def test_sigkill_of_a_lane_owner_loses_and_duplicates_nothing(settings, r, tmp_path):
    s = lanes_settings(settings, steal_after_ms=1000)
    env = {"REDROLL_AFFINITY_LANES": str(L), "REDROLL_STEAL_AFTER_MS": "1000"}
    args = ("worker", "--engine", "synthetic", "--token-ms", "4", "--max-inflight", "8")
    log = tmp_path / "workers.log"
    procs = [spawn(s, *args, log=log, **env) for _ in range(2)]
    applied: collections.Counter = collections.Counter()
    attempts: list[int] = []

    def handle(rec) -> None:
        applied.update([rec.request_id])
        attempts.append(rec.meta_info["attempt"])
    consumer = ConsumerRunner(s, group="g", handlers={"h": handle}, block_ms=100)
    try:
        async with running(consumer):
            async def owned_by_both() -> bool:
                report = await lane_report(r, s.keys, s.partition_keys)
                return len({x["owner"] for x in report["per_lane"]} - {None}) == 2
            await wait_until(owned_by_both, 20)
            total = 32 * 4
            await send(s, r, [make_request(request_id=f"k{g}_{m}", prompt=f"p{g}", group_id=f"k{g}", callback="h",
                                           sampling_params={"max_new_tokens": 16})
                              for g in range(32) for m in range(4)])
            await wait_until(lambda: sum(applied.values()) >= total // 4, 30)
            os.kill(procs[0].pid, signal.SIGKILL)
            procs[0].wait()
            killed_at = time.monotonic()
            await wait_until(lambda: sum(applied.values()) == total, 60)
            recovered_s = time.monotonic() - killed_at
            status = await collect_pipeline_status(r, s.keys, s.partition_keys)
    finally:
        for proc in procs:
            if proc.poll() is None:
                stop_process(proc)
    assert applied == collections.Counter({f"k{g}_{m}": 1 for g in range(32) for m in range(4)})
    results = collections.Counter(f[b"rid"].decode() for _, f in await r.xrange(s.keys.dead))
    assert results == collections.Counter()  # nothing dead-lettered
    # Queued lane entries go within the steal wait plus a few heartbeats; in-flight ones within claim_idle.
    assert recovered_s < s.claim_idle_ms / 1000 + s.steal_after_ms / 1000 + 10 * s.heartbeat_s
    assert status["queued_total"] == 0 and status["lanes"]["backlog"] == 0
    assert max(attempts) >= 2  # the dead worker's in-flight work was reclaimed and finished elsewhere


async def test_metrics_sum_the_backlog_over_the_lanes(settings, r):
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest

    from redroll.observability.metrics import WorkerMetrics

    s = lanes_settings(settings)
    async with Producer(s) as p:  # queued before any worker: 3 lanes and the shared stream
        await p.submit_many([dict(request_id=f"m{i}", prompt="x", sampling_params=SP, affinity_key=f"k{i}")
                             for i in range(6)] + [dict(request_id="m-plain", prompt="x", sampling_params=SP)])
    worker = Worker(s, SyntheticEngine(token_ms=1), max_inflight=8, block_ms=100, name="m")
    worker.metrics = WorkerMetrics(worker)
    async with running(worker):
        await wait_until(lambda: worker.stats.published == 7, 10)
        await wait_until(lambda: worker.stats.queued == 0, 5)
        text = generate_latest(worker.metrics.registry).decode()
    assert "redroll_pipeline_queued 0.0" in text
    assert 'redroll_worker_lane_claims_total{kind="own"}' in text
    assert 'redroll_worker_lane_claims_total{kind="shared"} 1.0' in text
    ops_doc = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()  # the metrics table
    assert "redroll_pipeline_queued" in ops_doc and "redroll_worker_lane_claims_total" in ops_doc
