"""``redroll trace``: each request's event log, and the timeline read back from it (real redis-server)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import pytest

from redroll.engine_worker.checkpoints import parse_checkpoint
from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.producer import Producer
from redroll.producer.client import make_request, send
from redroll.shared.types import RecordStatus
from redroll.trace import render_timeline, request_timeline, timeline_rows
from tests.conftest import ROOT, redroll_env, running, spawn, stop_process, wait_until, workers_and_consumer

PROMPT = list(range(1, 9))


def _request(rid: str, max_new_tokens: int = 8, **kw):
    return make_request(request_id=rid, input_ids=PROMPT, sampling_params={"max_new_tokens": max_new_tokens}, **kw)


def _trace_cli(settings, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "redroll.cli", "trace", *args], cwd=ROOT, env=redroll_env(settings),
                          capture_output=True, text=True, timeout=60)


async def test_a_finished_request_shows_submit_delivery_record_and_the_groups_that_applied_it(settings, r):
    applied: list[str] = []
    fleet, consumer = workers_and_consumer(settings, applied, workers=1)
    async with running(*fleet, consumer):
        await send(settings, r, [_request("fire-1", callback="h")])  # fire and forget: to the results stream
        await wait_until(lambda: "fire-1" in applied, 30)
        await wait_until(lambda: _applied_logged(r, settings, "fire-1"), 10)
        t = await request_timeline(r, settings.partition_keys, "fire-1")
    assert t.log_found and t.events_trimmed == 0 and t.gaps == []
    assert t.submitted is not None and t.submitted.producer is None and t.submitted.priority == "normal"
    assert t.submitted.stream == "requests"
    (d,) = t.deliveries
    assert d.worker == fleet[0].name and d.n == 1 and d.how == "read" and d.ended == "finished"
    (rec,) = t.records
    assert rec.status == "finished" and rec.worker == fleet[0].name and rec.tokens == 8
    assert rec.engine_ms is not None and rec.queue_ms is not None and rec.attempt == 1
    assert rec.reply == settings.keys.results and rec.in_redis is True
    assert [(a.group, a.consumer) for a in t.applied] == [("g", consumer.name)]
    assert 0 < t.ttl_s <= settings.event_log_ttl_s
    steps = [step for _, step, _ in timeline_rows(t)]
    assert steps == ["submitted", "delivery 1", "record", "applied"]
    assert json.loads(json.dumps(t.to_builtins()))["request_id"] == "fire-1"


async def _applied_logged(r, settings, rid: str) -> bool:
    return any(f.get(b"ev") == b"applied" for _, f in await r.xrange(settings.keys.events(rid)))


@pytest.mark.slow
async def test_a_request_whose_worker_was_killed_names_both_workers_the_checkpoint_and_the_finish(settings, r,
                                                                                                     tmp_path):
    s = settings.with_(checkpoint_tokens=20, checkpoint_interval_s=0.1, checkpoint_min_new_tokens=50)
    env = {"REDROLL_CHECKPOINT_TOKENS": "20", "REDROLL_CHECKPOINT_INTERVAL_S": "0.1",
           "REDROLL_CHECKPOINT_MIN_NEW_TOKENS": "50"}
    proc = spawn(s, "worker", "--engine", "synthetic", "--token-ms", "10", "--max-inflight", "4", "--name", "doomed",
                 log=tmp_path / "w.log", **env)
    request = make_request(request_id="killed-1", input_ids=PROMPT, resumable=True,
                           sampling_params={"max_new_tokens": 300, "sampling_seed": 7})
    try:
        async with Producer(s) as p:
            future = await p.submit(request)

            async def saved() -> bool:
                raw = await r.get(s.keys.partial("killed-1"))
                return bool(raw) and parse_checkpoint(raw).tokens >= 60
            await wait_until(saved, 30)
            mid = await request_timeline(r, s.partition_keys, "killed-1")
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            survivor = Worker(s, SyntheticEngine(token_ms=10), max_inflight=4, block_ms=100, name="survivor")
            async with running(survivor):
                record = await asyncio.wait_for(future, 30)
            producer = p.name
    finally:
        if proc.poll() is None:
            stop_process(proc)
    assert record.status is RecordStatus.FINISHED and record.meta_info["attempt"] >= 2
    # While it ran: in flight on the first worker, with a checkpoint.
    assert mid.now.owner == "doomed" and mid.now.checkpoint_tokens >= 60
    assert mid.deliveries[-1].ended == "still in flight"

    t = await request_timeline(r, s.partition_keys, "killed-1")
    assert t.submitted is not None and t.submitted.producer == producer
    first, second = t.deliveries
    assert (first.worker, first.n, first.ended) == ("doomed", 1, "worker died")
    assert (second.worker, second.how, second.previous, second.why) == ("survivor", "reclaimed", "doomed",
                                                                        "its worker died")
    assert second.ended == "finished" and first.entry == second.entry == t.submitted.entry
    # One event per delivery's run of checkpoints (the last save, with their count).
    doomed_saves, survivor_saves = t.checkpoints
    assert doomed_saves.worker == "doomed" and doomed_saves.tokens >= 60 and doomed_saves.saves >= 3
    assert survivor_saves.worker == "survivor" and survivor_saves.tokens > doomed_saves.tokens
    assert all(c.entry == first.entry for c in t.checkpoints)
    (rec,) = t.records
    assert rec.worker == "survivor" and rec.status == "finished" and rec.tokens == 300
    assert t.now.queued_entry is None and t.now.checkpoint_tokens is None  # the finish deleted both

    # The same from the command line, as a table and as JSON.
    out = _trace_cli(s, "killed-1")
    assert out.returncode == 0, out.stderr
    for text_ in ("doomed", "survivor", "worker died", "checkpoint", "finished"):
        assert text_ in out.stdout
    data = json.loads(_trace_cli(s, "killed-1", "--json").stdout)
    assert [d["worker"] for d in data["deliveries"]] == ["doomed", "survivor"]


async def test_a_trimmed_log_and_an_expired_one_are_reported_as_such(settings, r):
    s = settings.with_(event_log_max_len=2)
    worker = Worker(s, SyntheticEngine(), max_inflight=4, block_ms=100)
    async with running(worker), Producer(s) as p:
        record = await asyncio.wait_for(await p.submit(_request("trim-1")), 30)
    assert record.ok
    t = await request_timeline(r, s.partition_keys, "trim-1")
    # submitted, delivered, finished: the cap kept the last two.
    assert t.events_kept == 2 and t.events_trimmed == 1 and t.submitted is None
    assert [e.kind for e in t.events] == ["delivered", "finished"]
    assert any("trimmed" in g for g in t.gaps)
    # The producer read the record off its reply stream: the log's summary is all that is left.
    assert t.records[0].in_redis is False and any("no longer in" in g for g in t.gaps)

    await r.pexpire(s.keys.events("trim-1"), 1)
    await wait_until(lambda: _gone(r, s.keys.events("trim-1")), 10)
    gone = await request_timeline(r, s.partition_keys, "trim-1")
    assert not gone.log_found and gone.deliveries == [] and gone.records == []
    assert len(gone.gaps) == 1 and "expired" in gone.gaps[0]
    out = _trace_cli(s, "trim-1")
    assert out.returncode == 1 and "expired" in out.stdout
    render_timeline(gone)  # (draws without a step)


async def _gone(r, key: str) -> bool:
    return not await r.exists(key)


async def test_the_event_log_is_a_setting(settings, r):
    s = settings.with_(event_log=False)
    worker = Worker(s, SyntheticEngine(), max_inflight=4, block_ms=100)
    async with running(worker), Producer(s) as p:
        assert (await asyncio.wait_for(await p.submit(_request("off-1")), 30)).ok
    assert not await r.exists(s.keys.events("off-1"))
    t = await request_timeline(r, s.partition_keys, "off-1")
    assert not t.log_found and "off" in t.gaps[0]
