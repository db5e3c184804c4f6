"""A finish whose reply is lost (the script ran, the connection broke before its answer came) is
retried by the worker; the retry finds its own earlier success in the worker's finish marker and
reports the record as published, not as a lost lease (issue 44). A finish whose lease really was
lost is still reported fenced."""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis

from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.publisher import Publisher
from redroll.engine_worker.worker import Worker
from redroll.producer.client import make_request, send
from tests.conftest import wait_until


class LosesReplies:
    """Publisher._execute that runs on the server and then loses the reply, ``times`` times."""

    def __init__(self, monkeypatch, times: int = 1):
        self.lost = 0
        real = Publisher._execute

        async def execute(publisher, calls):
            replies = await real(publisher, calls)
            if self.lost < times:
                self.lost += 1
                raise redis.ConnectionError("reply lost (test)")
            return replies

        monkeypatch.setattr(Publisher, "_execute", execute)


@pytest.mark.parametrize("engine", ["per_request", "instant"])
async def test_a_finish_whose_reply_was_lost_is_reported_published(settings, r, monkeypatch, caplog, engine):
    caplog.set_level(logging.INFO, logger="redroll.worker")
    lost = LosesReplies(monkeypatch, times=2)
    worker = Worker(settings, SyntheticEngine(token_ms=1 if engine == "per_request" else 0), max_inflight=8,
                    block_ms=100)
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(worker.started.wait(), 10)
        await send(settings, r, [make_request(request_id=f"q{i}", prompt="x", sampling_params={"max_new_tokens": 3})
                                 for i in range(6)])
        await wait_until(lambda: worker.stats.published + worker.stats.fenced >= 6, timeout=20)
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 20)
    assert lost.lost == 2
    assert (worker.stats.published, worker.stats.fenced) == (6, 0)
    assert worker.stats.by_status == {"finished": 6}
    assert worker._outcomes is not None and worker._outcomes.ctx.publisher.found_published >= 1
    assert "lease lost" not in caplog.text
    assert "found its record published by the first try" in caplog.text
    assert await r.xlen(settings.keys.results) == 6  # each record once
    assert await r.xlen(settings.keys.requests) == 0


async def test_a_finish_after_the_lease_was_lost_is_still_fenced(settings, r, monkeypatch, caplog):
    """Another worker took the entry while this one generated: its finish (retried after a lost
    reply too) publishes nothing and is counted fenced."""
    caplog.set_level(logging.INFO, logger="redroll.worker")
    lost = LosesReplies(monkeypatch, times=1)
    engine = SyntheticEngine(token_ms=100)  # 10 tokens: 1 s
    worker = Worker(settings, engine, max_inflight=4, block_ms=100)
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(worker.started.wait(), 10)
        (entry,) = await send(settings, r, [make_request(request_id="stolen", prompt="x",
                                                         sampling_params={"max_new_tokens": 10})])
        await wait_until(lambda: worker.inflight_count == 1, timeout=10)
        taken = await r.xclaim(settings.keys.requests, "workers", "thief", 0, [entry])
        assert taken
        await wait_until(lambda: worker.stats.published + worker.stats.fenced >= 1, timeout=20)
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 20)
    assert (worker.stats.published, worker.stats.fenced) == (0, 1)
    assert "lease lost" in caplog.text
    assert await r.xlen(settings.keys.results) == 0
    assert lost.lost <= 1
