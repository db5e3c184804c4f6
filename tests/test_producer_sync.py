"""``SyncProducer``: the producer for non-async code, on a thread of its own."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from redroll.errors import ConnectionUnavailableError
from redroll.producer import SyncProducer
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
