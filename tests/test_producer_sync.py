"""``SyncProducer``: the producer for non-async code, on a thread of its own."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import threading

import pytest

from redroll.producer import SyncProducer
from redroll.shared.errors import ConnectionUnavailableError
from redroll.shared.types import RecordStatus
from tests.test_producer import SP, running_worker


def _producer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "redroll-producer"]


async def test_generate_submit_many_and_the_records(settings):
    async with running_worker(settings):
        sp = await asyncio.to_thread(SyncProducer, settings)
        try:
            rec = await asyncio.to_thread(lambda: sp.generate(prompt="hi", sampling_params=SP, timeout=10))
            assert rec.status is RecordStatus.FINISHED and len(rec.output_token_ids[0]) == 4
            futs = await asyncio.to_thread(
                sp.submit_many, [{"prompt": f"s{i}", "sampling_params": SP, "request_id": f"sync-{i}"}
                                 for i in range(5)])
            recs = await asyncio.to_thread(lambda: [f.result(10) for f in futs])
            assert [x.request_id for x in recs] == [f"sync-{i}" for i in range(5)]
            assert sp.outstanding == 0
        finally:
            await asyncio.to_thread(sp.close)
    assert not _producer_threads()


async def test_the_producer_options_reach_the_producer(settings, r):
    """``tokens_from_ids``: a restarted SyncProducer of the same name takes over its live request
    (one entry, its record comes to the new one); ``before_ack`` runs on the producer's thread."""
    first = await asyncio.to_thread(SyncProducer, settings, name="sync-batch", tokens_from_ids=True, block_ms=100)
    try:
        await asyncio.to_thread(first.submit, request_id="live-1", prompt="x", sampling_params=SP)
    finally:
        await asyncio.to_thread(first.close)
    before_ack_threads: list[str] = []
    again = await asyncio.to_thread(SyncProducer, settings, name="sync-batch", tokens_from_ids=True, block_ms=100,
                                    before_ack=lambda: before_ack_threads.append(threading.current_thread().name))
    try:
        fut = await asyncio.to_thread(again.submit, request_id="live-1", prompt="x", sampling_params=SP)
        assert await r.xlen(settings.keys.requests) == 1  # (taken over, not sent again)
        async with running_worker(settings) as worker:
            record = await asyncio.to_thread(fut.result, 10)
        assert record.status is RecordStatus.FINISHED and worker.stats.claimed == 1
        assert before_ack_threads and set(before_ack_threads) == {"redroll-producer"}
    finally:
        await asyncio.to_thread(again.close)


def test_options_are_checked_before_a_thread_starts(settings):
    with pytest.raises(ValueError, match="max_staleness needs batch_size"):
        SyncProducer(settings, max_staleness=1)
    assert not _producer_threads()


def test_a_producer_that_cannot_start_leaves_no_thread_behind(settings):
    unreachable = dataclasses.replace(settings, redis_url="redis://127.0.0.1:1/0")
    with pytest.raises(ConnectionUnavailableError, match="redis://127.0.0.1:1/0"):
        SyncProducer(unreachable)
    assert not _producer_threads()


def test_close_twice_is_harmless(settings):
    sp = SyncProducer(settings)
    sp.close()
    sp.close()
    assert not _producer_threads()


async def test_what_a_synchronous_trainer_needs(settings):
    """``submit_group`` (wait, take, stream), ``as_completed``, ``session``, ``update_weights`` and
    ``weight_sync`` with a ``push`` that runs on the producer's loop, all from plain threads."""
    torch = pytest.importorskip("torch")
    async with running_worker(settings):
        sp = await asyncio.to_thread(SyncProducer, settings, block_ms=100)
        try:
            def trainer() -> None:
                group = sp.submit_group(3, group_id="g1", prompt="p", sampling_params=SP)
                assert group.request_ids == ["g1_000", "g1_001", "g1_002"]
                assert sorted(r.request_id for r in group.stream(10)) == group.request_ids
                assert [r.request_id for r in group.wait(10)] == group.request_ids
                outcome = sp.submit_group(4, group_id="g2", prompt="p", sampling_params=SP).take(2, timeout=10)
                assert len(outcome.accepted) == 2 and outcome.members == 4
                futs = sp.submit_many([{"prompt": f"a{i}", "sampling_params": SP} for i in range(4)])
                assert len([r for r in sp.as_completed(futs, 10) if r.status is RecordStatus.FINISHED]) == 4
                session = sp.session("chat-s")
                first = session.turn([1, 2, 3], sampling_params=SP)
                assert first.status is RecordStatus.FINISHED and session.key == "chat-s"
                assert session.conversation == [1, 2, 3] + list(first.output_token_ids[0])
                workers = sp.update_weights("/ckpt/5", "5", timeout=10)
                assert workers and sp._producer.weight_version == 5

            await asyncio.to_thread(trainer)
        finally:
            await asyncio.to_thread(sp.close)
    alone = dataclasses.replace(settings, namespace=settings.namespace + "-alone")  # (a fleet of none)

    def push() -> None:
        with SyncProducer(alone) as p, p.weight_sync(timeout_s=10) as sync:
            report = sync.push(torch.nn.Linear(2, 2).named_parameters(), version="6")
            assert report.version == "6" and report.workers == []

    await asyncio.to_thread(push)
    assert not _producer_threads()


_CLOSE_SCRIPT = """
import asyncio, sys
from redroll.producer import SyncProducer
from redroll.shared.settings import Settings

async def keep(record):  # (a callback that starts work of its own on the producer's loop)
    asyncio.get_running_loop().create_task(asyncio.sleep(30))

with SyncProducer(Settings(redis_url=sys.argv[1], namespace=sys.argv[2]), block_ms=100) as p:
    futs = p.submit_many([{"prompt": f"p{i}", "sampling_params": {"max_new_tokens": 2}} for i in range(8)],
                         callback=keep)
    futs[0].result(20)
print("closed")
"""


async def test_close_leaves_no_task_pending(settings, tmp_path):
    """Closing with callbacks still due and tasks still on the loop (a read asked for ahead, work
    a callback started) never prints 'Task was destroyed but it is pending!' (10 runs)."""
    script = tmp_path / "close.py"
    script.write_text(_CLOSE_SCRIPT)
    async with running_worker(settings, token_ms=5):
        for run in range(10):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, str(script), settings.redis_url, settings.namespace,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0 and b"closed" in out, err.decode()
            assert b"Task was destroyed" not in err and b"never retrieved" not in err, f"run {run}: {err.decode()}"
