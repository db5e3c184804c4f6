"""Redis Sentinel: every process follows a failover by itself (a primary, a replica and three
sentinels on loopback ports, failing over one second after the primary stops answering)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import Counter
from typing import Iterator

import pytest
import redis

from redroll.producer.client import Producer
from redroll.shared.connection import connect_sync
from redroll.shared.functions import LIBRARY
from redroll.shared.settings import Settings
from redroll.shared.types import RecordStatus
from redroll.testing.embedded_sentinel import SentinelGroup, start_sentinel_group

from .conftest import ROOT, read_jsonl, redroll_env, server_executable, spawn, stop_process, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def sentinel_group() -> Iterator[SentinelGroup]:
    """A primary, one replica and three sentinels (down-after-milliseconds 1000) of the server
    under test."""
    group = start_sentinel_group(replicas=1, sentinels=3, down_after_ms=1000, executable=server_executable())
    yield group
    group.stop()


def _settings(group: SentinelGroup, namespace: str, **more) -> Settings:
    return Settings(redis_url=group.url, namespace=namespace, claim_idle_ms=1500, heartbeat_s=0.5,
                    drain_timeout_s=5.0, max_deliveries=10, **more)


WAIT_ENV = {"REDROLL_WAIT_REPLICAS": "1", "REDROLL_WAIT_TIMEOUT_MS": "500", "REDROLL_MAX_DELIVERIES": "10"}


async def test_sigkill_of_the_primary_mid_run_with_wait_replicas_loses_nothing_and_applies_nothing_twice(
        sentinel_group, namespace, tmp_path):
    """2,000 requests through two worker processes, all given only the redis+sentinel:// URL: 1,000
    fire-and-forget ones applied by a consumer process (group g), 1,000 a producer submits in
    chunks and awaits. The primary is SIGKILLed once a quarter of the callbacks ran, and comes back
    as a replica after the failover (as a supervisor would restart it: with one replica, WAIT 1
    needs it). Every producer future resolves FINISHED and the group applies each request_id
    exactly once."""
    from redroll.producer.client import make_request, send
    from redroll.shared.connection import connect

    group = sentinel_group
    s = _settings(group, namespace, wait_replicas=1, wait_timeout_ms=500)
    applied = tmp_path / "applied.jsonl"
    log = tmp_path / "procs.log"
    half = 1000
    # (8 in flight at 20 ms a token: about 200 requests a second, so the kill lands mid-run)
    procs = [spawn(s, "worker", "--engine", "synthetic", "--token-ms", "20", "--max-inflight", "8", log=log,
                   **WAIT_ENV) for _ in range(2)]
    procs.append(spawn(s, "consume", "--group", "g", "--handler", "apply=tests.handlers:append_to_file",
                       log=log, REDROLL_TEST_APPLIED=str(applied), **WAIT_ENV))
    failover: dict[str, float] = {}
    try:
        rc = connect(s)
        await send(s, rc, [make_request(request_id=f"cb-{i}", prompt=str(i), callback="apply",
                                        sampling_params={"max_new_tokens": 4}) for i in range(half)])
        await rc.aclose()
        async with Producer(s) as p:
            async def kill_then_restart() -> None:
                await wait_until(lambda: applied.exists() and len(read_jsonl(applied)) >= half // 4, timeout=120)
                loop = asyncio.get_running_loop()
                started = loop.time()
                failover["applied_at_kill"] = len(read_jsonl(applied))
                # The function library the processes call replicated: the replica that takes over has it.
                primary = group.primary_port()
                for node in group.nodes:
                    if node.port != primary:
                        with redis.Redis(port=node.port) as replica:
                            names = [lib[lib.index(b"library_name") + 1] for lib in replica.function_list()]
                            assert names == [LIBRARY.encode()], names
                old = await asyncio.to_thread(group.kill_primary)
                await asyncio.to_thread(group.wait_for_failover, old)
                failover["seconds"] = loop.time() - started
                await asyncio.to_thread(group.restart, old)

            killer = asyncio.create_task(kill_then_restart())
            futures = []
            for chunk in range(0, half, 50):
                futures += await p.submit_many([dict(request_id=f"p-{i}", prompt=str(i),
                                                     sampling_params={"max_new_tokens": 4})
                                                for i in range(chunk, chunk + 50)])
                await asyncio.sleep(0.1)
            await asyncio.wait_for(killer, 120)
            records = await asyncio.wait_for(asyncio.gather(*futures), 180)
        assert [r.status for r in records] == [RecordStatus.FINISHED] * half
        assert [r.request_id for r in records] == [f"p-{i}" for i in range(half)]
        await wait_until(lambda: len(read_jsonl(applied)) >= half, timeout=120, interval=0.2)
        await asyncio.sleep(1.0)  # (time for a duplicate application to show)
    finally:
        codes = [stop_process(proc) for proc in procs]
    if any(codes):
        print(log.read_text()[-4000:])
    assert codes == [0, 0, 0]
    counts = Counter(line["request_id"] for line in read_jsonl(applied))
    assert set(counts) == {f"cb-{i}" for i in range(half)}
    assert [rid for rid, c in counts.items() if c > 1] == []
    assert failover["applied_at_kill"] < half, failover  # the kill came mid-run
    print(f"failover after SIGKILL: {failover['seconds']:.1f}s; callbacks applied at the kill: "
          f"{failover['applied_at_kill']:.0f}")


async def test_a_demoted_primary_is_left_and_the_cli_reads_through_the_sentinels(sentinel_group, namespace):
    """A coordinated failover (SENTINEL FAILOVER) turns the primary into a replica while a producer
    and a worker hold connections to it: their writes answer READONLY there, and both follow the
    new primary. ``redroll status`` takes the sentinel URL like any other."""
    from redroll.engine_worker.engines.synthetic import SyntheticEngine
    from redroll.engine_worker.worker import Worker

    from .conftest import running

    group = sentinel_group
    s = _settings(group, namespace)
    worker = Worker(s, SyntheticEngine(), max_inflight=16, block_ms=200)
    async with Producer(s) as p, running(worker):
        first = await p.submit_many([dict(request_id=f"a-{i}", prompt=str(i)) for i in range(50)])
        assert {r.status for r in await asyncio.wait_for(asyncio.gather(*first), 60)} == {RecordStatus.FINISHED}
        old = group.primary_port()
        with redis.Redis(port=group.sentinels[0].port) as sentinel:
            sentinel.execute_command("SENTINEL", "FAILOVER", group.master)
        await asyncio.to_thread(group.wait_for_failover, old)
        with redis.Redis(port=old) as demoted:  # still running, now a replica
            await wait_until(lambda: demoted.info("replication")["role"] == "slave", timeout=30)
        second = await p.submit_many([dict(request_id=f"b-{i}", prompt=str(i)) for i in range(50)])
        assert {r.status for r in await asyncio.wait_for(asyncio.gather(*second), 60)} == {RecordStatus.FINISHED}
    sync = connect_sync(s)  # (the blocking client reads through the sentinels too)
    try:
        assert sync.info("replication")["role"] == "master"  # the new primary
    finally:
        sync.close()
    status = subprocess.run([sys.executable, "-m", "redroll.cli", "status", "--json"], cwd=ROOT,
                            env=redroll_env(s), capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)


def test_a_sentinel_url_that_reaches_no_sentinel_fails_in_one_line(namespace):
    env = redroll_env(Settings(redis_url="redis+sentinel://127.0.0.1:1/mymaster", namespace=namespace))
    out = subprocess.run([sys.executable, "-m", "redroll.cli", "status"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "redis+sentinel://127.0.0.1:1/mymaster" in out.stderr and "Traceback" not in out.stderr
    assert "no sentinel names a primary 'mymaster'" in out.stderr and len(out.stderr.strip().splitlines()) == 1

