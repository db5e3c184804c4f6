"""Multi-turn sessions through the queue: every turn on the worker that holds the conversation."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from redroll.engine_worker.engines.transformers_engine import TransformersEngine  # noqa: E402
from redroll.engine_worker.worker import Worker  # noqa: E402
from redroll.producer import Producer  # noqa: E402
from redroll.shared.types import RecordStatus  # noqa: E402
from tests.conftest import running, wait_until  # noqa: E402


async def test_a_session_resubmits_the_conversation_and_stays_on_one_worker(settings):
    s = settings.with_(affinity_lanes=4)
    workers = [Worker(s, TransformersEngine(prefix_cache_tokens=8192), max_inflight=4, block_ms=100, name=f"w{i}")
               for i in range(2)]
    async with running(*workers), Producer(s) as p:
        await wait_until(lambda: all(w.lanes is not None and len(w.lanes.owned) == 2 for w in workers), 30)
        await asyncio.sleep(3 * s.heartbeat_s)  # reads issued before the last ownership change are over
        session = p.session("chat-1")
        first = list(range(10, 50))
        records = [await session.turn(first, sampling_params={"max_new_tokens": 6, "temperature": 0})]
        for message in ([60, 61, 62], [70, 71]):
            before = len(session.conversation)
            records.append(await session.turn(message, sampling_params={"max_new_tokens": 6, "temperature": 0}))
            # The prompt was the whole conversation so far plus the message; all of it but the last
            # output token (never fed to the model) came from the worker's cache.
            assert records[-1].meta_info["prompt_tokens"] == before + len(message)
            assert records[-1].meta_info["cached_tokens"] == before - 1, [r.meta_info["worker"] for r in records]
    assert all(r.status is RecordStatus.FINISHED for r in records)
    assert [r.request_id for r in records] == ["chat-1-t0", "chat-1-t1", "chat-1-t2"]
    assert len({r.meta_info["worker"] for r in records}) == 1
    assert session.conversation[:40] == first and len(session.conversation) == 40 + 6 + 3 + 6 + 2 + 6
    with pytest.raises(ValueError, match="needs a message"):
        await p.session().turn([])
