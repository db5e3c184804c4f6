"""The pipeline on a 3-node Redis Cluster: P partitions {ns:0}..{ns:P-1} spread over the nodes.

Each test module run starts its own cluster (three cluster-enabled servers of the server under
test, primaries only) and stops it.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from typing import AsyncIterator, Iterator

import pytest
import redis
from redis.crc import key_slot

from redroll.consumer.runner import ConsumerRunner
from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.ops.backlog import group_backlog, requests_left
from redroll.ops.status import collect_pipeline_status
from redroll.ops.trace import request_timeline
from redroll.producer import Producer
from redroll.producer.client import make_request, send
from redroll.shared.connection import connect, is_cluster
from redroll.shared.keys import WORKERS_GROUP, Keys
from redroll.shared.settings import Settings
from redroll.shared.streams import text
from redroll.shared.types import RecordStatus
from redroll.testing.embedded import RedisCluster, start_redis_cluster
from tests.conftest import (
    ROOT,
    read_jsonl,
    redroll_env,
    run_until_drained,
    running,
    server_executable,
    spawn,
    stop_process,
    wait_until,
    workers_and_consumer,
)

GROUP = "trainer"


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    # Three primaries, and a replica of the first one (for the failover test).
    c = start_redis_cluster(3, replicas=1, executable=server_executable())
    yield c
    c.stop()


def _spread_namespace() -> str:
    """A fresh namespace whose six partitions cover all three nodes' slot ranges (thirds)."""
    while True:
        ns = "t" + uuid.uuid4().hex[:10]
        thirds = {key_slot(Keys(ns, i).requests.encode()) * 3 // 16384 for i in range(6)}
        if len(thirds) == 3:
            return ns


@pytest.fixture
def cluster_settings(cluster: RedisCluster) -> Settings:
    return Settings(redis_url=cluster.url, redis_cluster=True, namespace=_spread_namespace(), partitions=6,
                    claim_idle_ms=1500, heartbeat_s=0.5, drain_timeout_s=5.0, max_deliveries=3)


@pytest.fixture
async def rc(cluster_settings: Settings) -> AsyncIterator:
    client = connect(cluster_settings)
    await client.initialize()
    yield client
    await client.aclose()


async def _node_of(rc, key: str) -> int:
    return rc.get_node_from_key(key).port


async def test_partitions_spread_over_every_node(cluster_settings, rc):
    assert is_cluster(rc)
    ports = {await _node_of(rc, part.requests) for part in cluster_settings.partition_keys}
    assert len(ports) == 3, "six partitions land on all three nodes"
    # Every key of one partition shares its slot (scripts and MULTI never cross slots).
    for part in cluster_settings.partition_keys:
        keys = [part.requests, part.requests_high, part.results, part.dead, part.rid("x"), part.reply("p"),
                part.applied("g", 1)]
        assert len({rc.keyslot(k) for k in keys}) == 1


async def test_in_process_roles_on_the_cluster(cluster_settings, rc):
    """Producer futures, a group, fire-and-forget callbacks, queued aborts, status, dead letters and
    ``redroll trace`` (every request's event log)."""
    s = cluster_settings.with_(event_log="all")
    applied: list[str] = []
    async with Producer(s) as p:
        futs = await p.submit_many([dict(request_id=f"r-{i}", input_ids=[i + 1], sampling_params={"max_new_tokens": 3})
                                    for i in range(120)])
        group = await p.submit_group(8, group_id="prompt-1", input_ids=[7], sampling_params={"max_new_tokens": 3})
        await send(s, rc, [make_request(request_id=f"cb-{i}", input_ids=[1], callback="h",
                                        sampling_params={"max_new_tokens": 2}) for i in range(60)])
        queued = await p.submit_many([dict(request_id=f"q-{i}", prompt="x") for i in range(12)])
        assert sorted(await p.abort([f"q-{i}" for i in range(12)])) == sorted(f"q-{i}" for i in range(12))
        status = await collect_pipeline_status(rc, s.keys, s.partition_keys)
        assert status["requests"]["backlog"] == 188 and len(status["partitions"]) == 6
        # A malformed entry in partition 4 is dead-lettered into partition 4's dead stream.
        await rc.xadd(s.partition_keys[4].requests, {"rid": "bad", "data": b"\xc1"})

        workers, consumer = workers_and_consumer(s, applied)
        # burst roles: each stops once nothing is queued, claimed or left for its group (read in
        # one MULTI per partition's hash slot); the record "g" has no handler for does not hold it
        await run_until_drained(*workers, consumer, timeout=60)
        records = await asyncio.wait_for(asyncio.gather(*futs), 30)
        members = await group.wait(timeout=30)
        aborted = await asyncio.wait_for(asyncio.gather(*queued), 5)
    assert all(rec.status is RecordStatus.FINISHED for rec in records + members)
    assert all(rec.status is RecordStatus.ABORTED for rec in aborted)
    assert sorted(applied) == sorted(f"cb-{i}" for i in range(60))
    assert all(w.stats.published > 0 for w in workers)
    # The worker's dead letter in partition 4; the error record it published names no callback and
    # group "g" has no handler for that: it stays pending there for a consumer that has one.
    assert [await rc.xlen(k.dead) for k in s.partition_keys] == [0, 0, 0, 0, 1, 0]
    pending = [int((await rc.xpending(k.results, "g"))["pending"]) for k in s.partition_keys]
    assert pending == [0, 0, 0, 0, 1, 0]
    status = await collect_pipeline_status(rc, s.keys, s.partition_keys)
    assert status["requests"]["backlog"] == 0 and status["requests"]["pending"] == 0
    # The life of a request, read across the partitions: its finish and the group that applied it;
    # the malformed entry's dead letter in its partition.
    traced = await request_timeline(rc, s.partition_keys, "cb-7")
    assert [r.status for r in traced.records] == ["finished"] and traced.applied_by == ["g"]
    assert traced.submitted is not None and traced.deliveries[0].ended == "finished"
    bad = await request_timeline(rc, s.partition_keys, "bad")
    assert bad.events_key == s.partition_keys[4].events("bad") and bad.deliveries[0].ended == "dead-lettered"


async def _nothing_left(rc, s, group: str) -> bool:
    if await requests_left(rc, s.partition_keys):
        return False
    for part in s.partition_keys:
        if not (await group_backlog(rc, [part.results], group)).empty:
            return False
    return True


async def test_affinity_lanes_on_the_cluster(cluster_settings, rc):
    """Lanes live in their partition's slot; sessions and groups stay on one worker each."""
    from redroll.shared.keys import lane_index, partition_index

    s = cluster_settings.with_(affinity_lanes=4)
    for part in s.partition_keys:
        assert len({rc.keyslot(k) for k in (part.requests, *part.lane_streams)}) == 1
    applied: list[str] = []
    workers, consumer = workers_and_consumer(s, applied)
    async with running(*workers, consumer), Producer(s) as p:
        await wait_until(lambda: all(w.lanes is not None and w.lanes.owned for w in workers), 15)
        await asyncio.sleep(3 * s.heartbeat_s)
        groups = [await p.submit_group(4, group_id=f"cg-{i}", input_ids=[i + 1], sampling_params={"max_new_tokens": 3})
                  for i in range(12)]
        sessions = [p.session(f"cs-{i}") for i in range(6)]
        turns = [[await x.turn([i + 1, 2], sampling_params={"max_new_tokens": 2}) for _ in range(2)]
                 for i, x in enumerate(sessions)]
        members = [await g.wait(timeout=30) for g in groups]
        status = await collect_pipeline_status(rc, s.keys, s.partition_keys)
    for group in members:
        assert all(m.status is RecordStatus.FINISHED for m in group)
        assert len({m.meta_info["worker"] for m in group}) == 1
    assert all(len({t.meta_info["worker"] for t in ts}) == 1 for ts in turns)
    # A group's entries were in its partition's lane (by the same key) and nothing is left queued.
    key = "cg-0"
    part = s.partition_keys[partition_index(key, 6)]
    assert part.lane(lane_index(key, 4)).startswith(part.tag)
    assert status["lanes"]["lanes"] == 4 and len(status["lanes"]["per_lane"]) == 6 * 4
    assert status["queued_total"] == 0


@pytest.mark.timeout(300)
async def test_2000_requests_three_workers_six_partitions_callbacks_once(cluster_settings, rc, tmp_path):
    """The acceptance run: P = 6 over 3 nodes, 3 worker processes (one SIGKILLed mid-run and
    replaced), 2 consumer processes; every callback applied exactly once."""
    s = cluster_settings
    applied_file = tmp_path / "applied.jsonl"
    logs = tmp_path / "procs.log"
    flags = ("--cluster", "--partitions", "6")

    def start_worker():
        # 20 ms a token: each worker holds entries for about a second of the first half, so a
        # loaded machine's slow polls (twelve XPENDING calls each) still find the first worker holding some.
        return spawn(s, "worker", *flags, "--engine", "synthetic", "--token-ms", "20", "--max-inflight", "32", log=logs)

    workers = [start_worker() for _ in range(3)]
    consumers = [spawn(s, "consume", *flags, "--group", GROUP, "--handler", "apply=tests.handlers:append_to_file",
                       log=logs, REDROLL_TEST_APPLIED=str(applied_file)) for _ in range(2)]

    def applied_lines() -> list[dict]:
        return read_jsonl(applied_file)

    n = 2000
    try:
        await wait_until(lambda: _hlen_at_least(rc, s.keys.workers, 3), timeout=60)
        requests = [make_request(request_id=f"c-{i}", input_ids=[1 + i % 200, 2], callback="apply",
                                 group_id=f"g-{i // 4}", sampling_params={"max_new_tokens": 4 + i % 5})
                    for i in range(n)]
        await send(s, rc, requests[: n // 2])

        async def first_worker_stopped_holding_entries() -> bool:  # (as soon as it holds entries)
            if await _pending_of(rc, s, workers[0].pid) == 0:
                return False
            workers[0].send_signal(signal.SIGSTOP)  # (then it cannot finish them before the kill)
            if await _pending_of(rc, s, workers[0].pid) > 0:
                return True
            workers[0].send_signal(signal.SIGCONT)
            return False

        await wait_until(first_worker_stopped_holding_entries, timeout=60, interval=0.01)
        workers[0].send_signal(signal.SIGKILL)  # its leased entries must be reclaimed, not lost
        workers[0].wait(10)
        workers.append(start_worker())
        await send(s, rc, requests[n // 2:])
        await wait_until(lambda: len(applied_lines()) >= n, timeout=180, interval=0.2)
        # nothing left anywhere (no request, no unread or unacked record of the group): no duplicate
        # can still be applied, so the count below is final
        await wait_until(lambda: _nothing_left(rc, s, GROUP), timeout=60)
        lines = applied_lines()
    finally:
        if workers[0].poll() is None:  # (the test failed before the kill; SIGKILL ends a stopped process too)
            workers[0].kill()
            workers[0].wait(10)
        codes = [stop_process(p) for p in workers[1:] + consumers]
    if any(codes):
        print(logs.read_text()[-5000:])
    assert codes == [0] * len(codes)
    assert "was in flight on a worker that died" in logs.read_text(), "the killed worker's entries were reclaimed"

    counts = Counter(x["request_id"] for x in lines)
    assert set(counts) == {req.request_id for req in requests}
    assert max(counts.values()) == 1, "a callback was applied twice"
    assert all(x["status"] == "finished" for x in lines)
    # Placement: each request was generated in the partition its group_id hashes to, and every
    # partition (so every node) took work.
    per_partition = Counter(s.keys_for(req).tag for req in requests)
    assert len(per_partition) == 6
    for part in s.partition_keys:
        assert await rc.xlen(part.requests) == 0
        assert int((await rc.xpending(part.requests, WORKERS_GROUP))["pending"]) == 0
        assert int((await rc.xpending(part.results, GROUP))["pending"]) == 0
        assert await rc.xlen(part.dead) == 0


async def _hlen_at_least(r, key: str, n: int) -> bool:
    return await r.hlen(key) >= n


async def _pending_of(r, settings: Settings, pid: int) -> int:
    """Request entries the worker process ``pid`` holds now (its consumer names carry its pid)."""
    held = 0
    for part in settings.partition_keys:
        for stream in (part.requests_high, part.requests):
            info = await r.xpending(stream, WORKERS_GROUP)
            held += sum(int(c["pending"]) for c in info.get("consumers") or []
                        if f"-{pid}-" in text(c["name"]))
    return held


def _migrate_slot(cluster: RedisCluster, slot: int, source: int, target: int) -> int:
    """Move ``slot`` from primary ``source`` to primary ``target`` the way redis-cli --cluster
    reshard does (IMPORTING/MIGRATING, MIGRATE of every key, SETSLOT NODE): clients see ASK and
    TRYAGAIN during the move and MOVED after it. Returns the number of keys moved."""
    src = redis.Redis(port=cluster.nodes[source].port, decode_responses=True)
    dst = redis.Redis(port=cluster.nodes[target].port, decode_responses=True)
    src_id, dst_id = src.cluster("MYID"), dst.cluster("MYID")
    dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
    src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
    moved = 0
    while True:
        keys = src.execute_command("CLUSTER GETKEYSINSLOT", slot, 10)
        if not keys:
            break
        src.execute_command("MIGRATE", "127.0.0.1", cluster.nodes[target].port, "", 0, 5000, "KEYS", *keys)
        moved += len(keys)
        time.sleep(0.02)  # let traffic interleave with the move
    for node in cluster.nodes[:cluster.primaries]:
        redis.Redis(port=node.port).execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
    return moved


@pytest.mark.timeout(120)
async def test_resharding_and_failover_under_traffic(cluster, cluster_settings, rc):
    """A partition's slot moves to another node (ASK/TRYAGAIN, then MOVED) and then its
    first node fails over to its replica (CLUSTER FAILOVER), both while requests flow: nothing is
    lost, no callback runs twice."""
    s = cluster_settings
    slot_owner = {part.tag: rc.get_node_from_key(part.requests).port for part in s.partition_keys}
    part = next(p for p in s.partition_keys if slot_owner[p.tag] == cluster.nodes[0].port)
    slot = key_slot(part.requests.encode())
    applied: Counter = Counter()
    workers = [Worker(s, SyntheticEngine(token_ms=1), max_inflight=16, block_ms=200) for _ in range(2)]
    consumer = ConsumerRunner(s, group="g", handlers={"h": lambda rec: applied.update([rec.request_id])},
                              block_ms=200)
    futures: list = []
    sent: list[str] = []

    async with running(*workers, consumer):
        async with Producer(s) as p:
            async def traffic(prefix: str, batches: int) -> None:
                for b in range(batches):
                    # Half wait on producer futures (private reply streams), half go to the results
                    # streams for the consumer group's callbacks.
                    futures.extend(await p.submit_many([
                        dict(request_id=f"{prefix}-{b}-p{i}", input_ids=[i + 1], sampling_params={"max_new_tokens": 3})
                        for i in range(20)]))
                    reqs = [make_request(request_id=f"{prefix}-{b}-c{i}", input_ids=[i + 1], callback="h",
                                         sampling_params={"max_new_tokens": 3}) for i in range(20)]
                    await send(s, rc, reqs)
                    sent.extend(r.request_id for r in reqs)
                    await asyncio.sleep(0.05)

            flow = asyncio.create_task(traffic("m", 20))
            await asyncio.sleep(0.2)
            moved = await asyncio.to_thread(_migrate_slot, cluster, slot, 0, 1)
            await flow
            counts = [redis.Redis(port=n.port).execute_command("CLUSTER COUNTKEYSINSLOT", slot)
                      for n in cluster.nodes[:2]]
            assert moved >= 2 and counts[0] == 0 and counts[1] > 0

            # Manual failover of the first primary (still owning other partitions' slots) to its replica.
            flow = asyncio.create_task(traffic("f", 20))
            await asyncio.sleep(0.2)
            replica = redis.Redis(port=cluster.nodes[-1].port, decode_responses=True)
            replica.execute_command("CLUSTER FAILOVER")
            await wait_until(lambda: replica.info("replication")["role"] == "master", timeout=30)
            await flow
            try:
                records = await asyncio.wait_for(asyncio.shield(asyncio.gather(*futures)), 60)
            except asyncio.TimeoutError:
                missing = await _explain_missing(rc, s, p, futures, workers)
                raise AssertionError(missing) from None
            await wait_until(lambda: len(applied) >= len(sent), timeout=60)
        await asyncio.sleep(0.5)
    assert all(rec.status is RecordStatus.FINISHED for rec in records)
    assert set(applied) == set(sent) and max(applied.values()) == 1
    status = await collect_pipeline_status(rc, s.keys, s.partition_keys)
    assert status["requests"]["backlog"] == 0 and status["requests"]["pending"] == 0
    assert status["dead_letters"] == 0


async def _explain_missing(rc, s: Settings, producer, futures, workers) -> str:
    """Print where the requests whose records never came are (for a failure report); a one-line
    summary is returned for the assertion (the printed part may be cut from a long report)."""
    missing = [f for f in futures if not f.done()]
    summary = f"{len(missing)} of {len(futures)} records missing; waiters: {list(producer.pending.waiting)[:10]}"
    print(summary)
    for part in s.partition_keys:
        node = rc.get_node_from_key(part.requests).port
        pend = await rc.xpending(part.requests, WORKERS_GROUP)
        print(part.tag, node, "requests", await rc.xlen(part.requests), "pending", pend,
              "reply", await rc.xlen(part.reply(producer.name)),
              "reply pending", await rc.xpending(part.reply(producer.name), "producer"))
    for w in workers:
        print(w.name, w.stats, "inflight", len(w.flights), "isolating", w.flights.isolating,
              "holds", w.flights.holds, "parked", w.flights.parked)
    print("producer readers", [(t.get_name(), t.done()) for t in producer._readers])
    for t in asyncio.all_tasks():
        print("task", t.get_name(), t.get_stack(limit=2)[-1:] if not t.done() else "done")
    return summary


def _cli(s: Settings, *args: str, input: str | None = None) -> subprocess.CompletedProcess:
    env = redroll_env(s, REDROLL_REDIS_CLUSTER="1", REDROLL_PARTITIONS=str(s.partitions))
    return subprocess.run([sys.executable, "-m", "redroll.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, input=input)


@pytest.mark.timeout(180)
async def test_operator_commands_on_the_cluster(cluster_settings, rc):
    """submit --wait, status, dead list/requeue, abort, weights, gc and drain with --cluster."""
    s = cluster_settings
    worker = spawn(s, "worker", "--cluster", "--partitions", "6", "--engine", "synthetic",
                   REDROLL_GC_INTERVAL_S="3600")
    try:
        await wait_until(lambda: _hlen_at_least(rc, s.keys.workers, 1), timeout=60)
        lines = "".join(json.dumps({"request_id": f"s-{i}", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
                        + "\n" for i in range(20))
        sub = await asyncio.to_thread(_cli, s, "submit", "-", "--wait", "--no-progress", input=lines)
        assert sub.returncode == 0, sub.stderr[-2000:]
        assert sorted(json.loads(x)["request_id"] for x in sub.stdout.splitlines()) == sorted(f"s-{i}" for i in range(20))

        # A malformed entry in partition 2 → dead letter; list it, requeue fails validation again.
        await rc.xadd(s.partition_keys[2].requests, {"rid": "bad", "data": b"\xc1"})
        await wait_until(lambda: rc.xlen(s.partition_keys[2].dead), timeout=20)
        dead = await asyncio.to_thread(_cli, s, "dead", "list", "--json")
        assert dead.returncode == 0, dead.stderr[-2000:]
        assert "not valid msgpack" in dead.stdout

        status = await asyncio.to_thread(_cli, s, "status", "--json")
        assert status.returncode == 0, status.stderr[-2000:]
        doc = json.loads(status.stdout)
        assert doc["workers_alive"] == 1 and doc["dead_letters"] == 1 and len(doc["partitions"]) == 6
        nodes = {f"127.0.0.1:{rc.get_node_from_key(part.requests).port}" for part in s.partition_keys}
        assert {p["node"] for p in doc["partitions"]} == nodes and len(nodes) == 3
        table = await asyncio.to_thread(_cli, s, "status")
        assert table.returncode == 0 and "partitions" in table.stdout, table.stderr[-2000:]

        abort = await asyncio.to_thread(_cli, s, "abort", "nothing-here")
        assert abort.returncode == 0, abort.stderr[-2000:]
        weights = await asyncio.to_thread(_cli, s, "weights", "update", "--model-path", "/ckpt/2", "--version", "2",
                                          "--timeout", "30")
        assert weights.returncode == 0, weights.stderr[-2000:]
        # A reply stream without TTL, last written long ago: gc finds it (SCAN on every node).
        await rc.xadd(s.partition_keys[5].reply("gone-producer"), {"rid": "x"}, id="1-1")
        # ... and a rid key whose entry is gone (release_rids on the partition's node).
        await rc.set(s.partition_keys[4].rid("cancelled"), "tok 1-1")
        gc = await asyncio.to_thread(_cli, s, "gc", "--dry-run")
        assert gc.returncode == 0, gc.stderr[-2000:]
        assert s.partition_keys[5].reply("gone-producer") in gc.stdout + gc.stderr
        assert json.loads(gc.stdout)["removed"]["rid_keys"] == [s.partition_keys[4].rid("cancelled")]
        assert await rc.exists(s.partition_keys[4].rid("cancelled"))  # (a dry run)
        drain = await asyncio.to_thread(_cli, s, "drain", "--all")
        assert drain.returncode == 0, drain.stderr[-2000:]
        assert await asyncio.to_thread(worker.wait, 30) == 0
    finally:
        stop_process(worker)
