"""Affinity lanes (real redis-server): placement, agreement on L, ownership, stealing, kills, drain, abort.

With ``affinity_lanes`` L > 0 a request with an affinity key (or a group id) queues on lane
``lane_index(key, L)``; each lane is owned by one claiming worker; an entry that waits longer
than ``steal_after_ms`` in a lane is taken by any worker. The delivery promises are unchanged.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import time
from pathlib import Path

import pytest

from redroll.consumer.runner import ConsumerRunner
from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.lane_plan import lane_heirs, lane_owners
from redroll.engine_worker.lanes import LaneTable, has_room
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
    owners = lane_owners(["a", "b", "c"], 8)
    assert max(collections.Counter(owners).values()) <= 3 and set(owners) == {"a", "b", "c"}
    assert lane_owners(["c", "a", "b"], 8) == owners  # the same on every worker
    after = lane_owners(["a", "b"], 8)  # c died: only what c held (and the cap) moves
    assert sum(x != y for x, y in zip(owners, after)) <= 5
    assert lane_owners([], 3) == [None, None, None]


def test_lane_owners_at_fleet_size_are_balanced_and_a_newcomer_moves_few():
    names = [f"worker-host-{i}" for i in range(1024)]
    owners = lane_owners(reversed(names), 4096)
    assert collections.Counter(owners) == {n: 4 for n in names}  # every worker, ceil(L / W) lanes each
    joined = lane_owners([*names, "newcomer"], 4096)
    # (the newcomer takes a few lanes; the others stay where they were, but for a few the cap pushes on)
    assert sum(x != y for x, y in zip(owners, joined)) < 64 and joined.count("newcomer") >= 1


async def test_a_burst_of_joins_makes_one_new_member_list(settings, r):
    """The member list is published at most once per settle time: a fleet that starts (hundreds of
    joins in seconds) makes a few lists, not one per worker, so each worker computes few plans."""
    s = settings.with_(affinity_lanes=8)
    tables = [lane_table(s, r, f"w{i}", settle_ms=60_000) for i in range(5)]
    for t in tables:
        await t.beat({"state": "running"}, room=True)
    assert [t.epoch for t in tables] == [1] * 5  # the first join published at once, the rest wait
    assert all(t.members == ["w0"] for t in tables) and set(tables[4].owners) == {"w0"}
    tables[4].settle_ms = 0  # (the settle time has passed)
    await tables[4].beat({"state": "running"}, room=True)
    await tables[0].beat({"state": "running"}, room=True)
    assert tables[0].epoch == tables[4].epoch == 2 and tables[0].members == [f"w{i}" for i in range(5)]
    assert tables[0].owners == tables[4].owners == lane_owners(tables[0].members, 8)


def test_a_beat_has_room_only_when_it_says_so():
    assert has_room({"inflight": 3, "max_inflight": 8}) and has_room({"room": True, "inflight": 8, "max_inflight": 8})
    assert not has_room({"inflight": 8, "max_inflight": 8}) and not has_room({"room": False, "inflight": 0})
    assert not has_room({"state": "running"}) and not has_room(None) and not has_room({"inflight": "x"})


def lane_table(s, r, name: str = "me", settle_ms: int = 0) -> LaneTable:
    from types import SimpleNamespace

    from redroll.shared.scripts import Scripts

    ctx = SimpleNamespace(settings=s, redis=r, keys=s.keys, name=name, metrics=None, scripts=Scripts(r),
                          parts=[s.keys], request_streams=s.keys.request_streams)
    table = LaneTable(ctx, interval_s=s.heartbeat_s)
    table.settle_ms = settle_ms
    return table


async def test_the_lane_table_says_who_claims_who_is_full_or_late_and_changes_its_epoch_only_on_joins_and_leaves(
        settings, r):
    """Each worker's heartbeat keeps the lane table (lanes_beat.lua): the claiming workers and the
    time of their last beat; only a join or a leave changes the epoch (and only then is the member
    list sent back); a member silent for three beats is dropped."""
    s = settings.with_(affinity_lanes=64)
    me, busy, quiet, idle = (lane_table(s, r, n) for n in ("me", "busy", "quiet", "idle"))
    running = {"state": "running"}
    await busy.beat(running, room=False)
    await quiet.beat(running, room=True)
    await idle.beat(running, room=True)
    assert me.scanned == list(range(64))  # before its first beat: every lane
    await me.beat(running, room=True)
    names = {"me", "busy", "quiet", "idle"}
    assert me.owners == lane_owners(names, 64) and set(me.owners) == names
    assert me.full == {"busy"} and me.late == set()
    # It scans only the lanes of the owner without room; it reclaims only its own.
    assert me.scanned == [j for j, o in enumerate(me.owners) if o == "busy"]
    assert me.reclaimed == me.owned and 0 < len(me.owned) < 64
    assert me.reclaim_streams() == [s.keys.requests_high, *(s.keys.lane(j) for j in me.owned), s.keys.requests]
    # A beat that changes nobody's membership keeps the epoch: no member list comes back.
    epoch = me.epoch
    _, _, _, members = await me.ctx.scripts.lanes_beat(s.keys, "me", "{}", claiming=True, room=True, late_ms=1000,
                                                     stale_ms=10_000, settle_ms=0, epoch=epoch)
    assert members is None
    # quiet's beat is late (older than late_ms): its lanes are scanned too; past stale it is dropped.
    await r.zadd(s.keys.lane_members, {"quiet": int(time.time() * 1000) - me.late_ms - 100})
    await me.beat(running, room=True)
    assert me.epoch == epoch and me.late == {"quiet"}
    heirs = lane_heirs(names, 64, {"quiet"}, range(64))  # (who looks after quiet's lanes while it is late)
    assert me.scanned == [j for j, o in enumerate(me.owners) if o == "busy" or (o == "quiet" and heirs[j] == "me")]
    await r.zadd(s.keys.lane_members, {"quiet": 1})
    await me.beat(running, room=True)
    assert me.epoch != epoch and "quiet" not in me.owners and me.late == set()  # dropped, its lanes moved
    # A worker that stops claiming (paused) leaves the table; so does one that deregisters.
    await busy.beat({"state": "paused"}, room=False)
    await idle.leave()
    await me.beat(running, room=True)
    assert set(me.owners) == {"me"} and me.full == set() and me.scanned == []
    assert await r.hexists(s.keys.workers, "busy") and not await r.hexists(s.keys.workers, "idle")


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


async def beat_forever(s, r, name: str, stop: asyncio.Event, *, room: bool, beats: int | None = None) -> None:
    """A worker that says it is claiming and never claims: full (``room`` False), or silent after
    ``beats`` beats (hung, or dead before its beat went stale)."""
    table = lane_table(s, r, name)
    n = 0
    while not stop.is_set() and (beats is None or n < beats):
        await table.beat({"state": "running", "pid": 0}, room=room)
        n += 1
        await asyncio.sleep(0.2)


@pytest.mark.parametrize("ghost", [dict(room=False), dict(room=True, beats=1)], ids=["says-it-is-full", "falls-silent"])
async def test_entries_on_a_silent_or_full_owners_lanes_are_stolen_after_the_wait(settings, r, ghost):
    # A full owner's lanes are scanned from its beat on; a silent one's once its beat is late.
    s = lanes_settings(settings, steal_after_ms=400)
    worker = Worker(s, SyntheticEngine(token_ms=1), max_inflight=8, block_ms=100, name="real")
    stop = asyncio.Event()
    beats = asyncio.create_task(beat_forever(s, r, "ghost", stop, **ghost))
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
        await beats
    assert all(x.status is RecordStatus.FINISHED for x in own_records + stolen_records)
    assert all(x.meta_info["queue_ms"] < 400 for x in own_records)
    assert all(x.meta_info["queue_ms"] >= 400 for x in stolen_records)
    # within the steal wait and, for a silent owner, its beat's lateness and one of this worker's beats
    assert waited < 3.0 + worker.lanes.late_ms / 1000 + s.heartbeat_s
    assert worker.stats.claims_by_kind["stolen"] == len(theirs)


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
