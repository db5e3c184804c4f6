"""``redroll trace``: each request's event log, and the timeline read back from it and from what
Redis still holds (real redis-server)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid

import pytest

from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.ops.trace import render_timeline, request_timeline, timeline_rows
from redroll.producer import Producer
from redroll.producer.client import make_request, send
from redroll.security.acl import setuser_args
from redroll.shared.checkpoint_reads import load_checkpoint
from redroll.shared.connection import connect
from redroll.shared.events import EventLog
from redroll.shared.keys import WORKERS_GROUP
from redroll.shared.scripts import DeadLetter, Scripts
from redroll.shared.streams import ensure_group
from redroll.shared.types import CompletionRecord, RecordStatus
from tests.conftest import ROOT, redroll_env, running, spawn, stop_process, wait_until, workers_and_consumer

PROMPT = list(range(1, 9))


def _request(rid: str, max_new_tokens: int = 8, **kw):
    return make_request(request_id=rid, input_ids=PROMPT, sampling_params={"max_new_tokens": max_new_tokens}, **kw)


def _trace_cli(settings, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "redroll.cli", "trace", *args], cwd=ROOT, env=redroll_env(settings),
                          capture_output=True, text=True, timeout=60)


async def test_a_finished_request_shows_its_submit_delivery_record_and_the_groups_that_applied_it(settings, r):
    settings = settings.with_(event_log="all")
    applied: list[str] = []
    fleet, consumer = workers_and_consumer(settings, applied, workers=1)
    async with running(*fleet, consumer):
        await send(settings, r, [_request("fire-1", callback="h")])  # fire and forget: to the results stream
        await wait_until(lambda: "fire-1" in applied, 30)
        t = await request_timeline(r, settings.partition_keys, "fire-1")
    # A request that ran once costs the log one event: its finish.
    assert [e.kind for e in t.events] == ["finished"] and t.events_trimmed == 0 and t.gaps == []
    assert t.submitted is not None and t.submitted.producer is None and t.submitted.priority == "normal"
    assert t.submitted.stream == "requests" and t.submitted.lane is None
    (d,) = t.deliveries
    assert d.worker == fleet[0].name and d.n == 1 and d.ended == "finished"
    assert d.at is None  # (a first delivery is not logged: its worker is the one that finished it)
    (rec,) = t.records
    assert rec.status == "finished" and rec.worker == fleet[0].name and rec.tokens == 8 and rec.attempt == 1
    assert rec.engine_ms is not None and rec.queue_ms is not None and rec.weight_version is not None
    assert rec.reply == settings.keys.results and rec.in_redis is True
    assert t.applied_by == ["g"]
    assert 0 < t.ttl_s <= settings.event_log_ttl_s
    assert [step for _, step, _ in timeline_rows(t)] == ["submitted", "delivery 1", "record", "consumer group"]
    assert json.loads(json.dumps(t.to_builtins()))["request_id"] == "fire-1"

    # The read-only operator ACL user may trace (and reads the same).
    password = uuid.uuid4().hex
    version = (await r.info("server"))["redis_version"]
    await r.execute_command("ACL", "SETUSER", *setuser_args(f"op-{settings.namespace}", password, "operator",
                                                            settings.namespace, server_version=version))
    try:
        op = connect(settings.with_(redis_username=f"op-{settings.namespace}", redis_password=password))
        try:
            seen = await request_timeline(op, settings.partition_keys, "fire-1")
        finally:
            await op.aclose()
    finally:
        await r.execute_command("ACL", "DELUSER", f"op-{settings.namespace}")
    assert seen.to_builtins() == {**t.to_builtins(), "ttl_s": seen.ttl_s}


async def test_a_queued_request_is_traced_from_its_entry(settings, r):
    async with Producer(settings) as p:
        await p.submit(_request("queued-1", priority=1))  # (no worker runs)
        t = await request_timeline(r, settings.partition_keys, "queued-1")
        assert not t.log_found and t.gaps == [] and t.deliveries == []
        assert t.submitted is not None and t.submitted.priority == "high" and t.submitted.producer == p.name
        assert t.now.queued_entry == t.submitted.entry and t.now.owner is None


@pytest.mark.slow
async def test_a_request_whose_worker_was_killed_names_both_workers_the_checkpoint_and_the_finish(settings, r,
                                                                                                     tmp_path):
    # (event_log=all: a first delivery's checkpoints are logged too; with incidents they begin no log)
    s = settings.with_(checkpoint_tokens=20, checkpoint_interval_s=0.1, checkpoint_min_new_tokens=50, event_log="all")
    env = {"REDROLL_CHECKPOINT_TOKENS": "20", "REDROLL_CHECKPOINT_INTERVAL_S": "0.1",
           "REDROLL_CHECKPOINT_MIN_NEW_TOKENS": "50", "REDROLL_EVENT_LOG": "all"}
    proc = spawn(s, "worker", "--engine", "synthetic", "--token-ms", "10", "--max-inflight", "4", "--name", "doomed",
                 log=tmp_path / "w.log", **env)
    request = make_request(request_id="killed-1", input_ids=PROMPT, resumable=True,
                           sampling_params={"max_new_tokens": 300, "sampling_seed": 7})
    try:
        async with Producer(s) as p:
            future = await p.submit(request)

            async def saved() -> bool:
                cp = await load_checkpoint(r, s.keys, "killed-1")
                return cp is not None and cp.tokens >= 60
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
    assert mid.now.owner == "doomed" and mid.now.checkpoint_tokens >= 60 and mid.submitted.producer == producer
    assert [(d.worker, d.ended) for d in mid.deliveries] == [("doomed", "still in flight")]

    t = await request_timeline(r, s.partition_keys, "killed-1")
    assert t.submitted is not None and t.submitted.producer == producer
    first, second = t.deliveries
    assert (first.worker, first.n, first.ended) == ("doomed", 1, "worker died")
    assert (second.worker, second.previous, second.why, second.ended) == ("survivor", "doomed", "its worker died",
                                                                          "finished")
    assert first.entry == second.entry == t.submitted.entry and second.at is not None
    # One event per delivery's run of checkpoints: its last consolidation (the first save of a
    # delivery; the saves after it, parts only, until the next one), with the saves so far.
    doomed_saves, survivor_saves = t.checkpoints
    assert doomed_saves.worker == "doomed" and 20 <= doomed_saves.tokens < 60 and doomed_saves.saves == 1
    # (the survivor's first save consolidated what the doomed worker had saved as parts after that)
    assert survivor_saves.worker == "survivor" and survivor_saves.tokens >= record.meta_info["resumed_from"] >= 60
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
    """Four events (three workers' checkpoints, a finish) in a log capped at 360 bytes: the oldest
    give way to a count of them."""
    keys = settings.keys
    scripts = Scripts(r, EventLog(max_bytes=360, ttl_s=60))
    await ensure_group(r, keys.requests, WORKERS_GROUP)
    entry = (await r.xadd(keys.requests, {"rid": "trim-1", "data": b"x"})).decode()
    await r.xreadgroup(WORKERS_GROUP, "w1", {keys.requests: ">"})
    for k, worker in enumerate(("w1", "w2", "w3")):
        if worker != "w1":
            await r.xclaim(keys.requests, WORKERS_GROUP, worker, 0, [entry])
        assert (await scripts.checkpoint(requests_key=keys.requests, partial_key=keys.partial("trim-1"),
                                         group=WORKERS_GROUP, consumer=worker, entry_id=entry, saved=k, adding=1,
                                         part=b"p", ttl_s=60))[0] == 1
    record = CompletionRecord(request_id="trim-1", status=RecordStatus.FINISHED, output_token_ids=[[1]],
                              finish_reasons=["length"], worker="w3")
    assert await scripts.finish(requests_key=keys.requests, reply_key=keys.results, rid_key=keys.rid("trim-1"),
                                group=WORKERS_GROUP, consumer="w3", entry_id=entry, record=record) == 1
    t = await request_timeline(r, keys, "trim-1")
    kinds = [e.kind for e in t.events]
    assert kinds[0] == "trimmed" and kinds[-1] == "finished" and t.events_trimmed >= 1
    assert t.events_trimmed + len(kinds) - 1 == 4 and await r.strlen(keys.events("trim-1")) <= 360
    assert any(f"oldest {t.events_trimmed} event(s) were trimmed" in g for g in t.gaps)
    assert t.records[0].worker == "w3" and all(c.worker == "w3" for c in t.checkpoints)

    await r.pexpire(keys.events("trim-1"), 1)
    await wait_until(lambda: _gone(r, keys.events("trim-1")), 10)
    gone = await request_timeline(r, keys, "trim-1")
    assert not gone.log_found and gone.deliveries == [] and gone.records == []
    assert len(gone.gaps) == 1 and "expired" in gone.gaps[0]
    out = _trace_cli(settings, "trim-1")
    assert out.returncode == 1 and "expired" in out.stdout
    render_timeline(gone)  # (draws without a step)


async def _gone(r, key: str) -> bool:
    return not await r.exists(key)


@pytest.mark.parametrize("mode", ["off", "incidents"])
async def test_without_an_incident_only_all_logs_a_request(settings, r, mode):
    s = settings.with_(event_log=mode)
    worker = Worker(s, SyntheticEngine(), max_inflight=4, block_ms=100)
    async with running(worker), Producer(s) as p:
        assert (await asyncio.wait_for(await p.submit(_request("plain-1")), 30)).ok
    assert not await r.exists(s.keys.events("plain-1"))
    t = await request_timeline(r, s.partition_keys, "plain-1")
    assert not t.log_found and "incident" in t.gaps[0] and "off" in t.gaps[0]


def test_the_event_log_mode_is_checked():
    from redroll.shared.settings import Settings

    with pytest.raises(ValueError, match="event_log"):
        Settings(event_log="some")
    assert Settings.from_env({"REDROLL_EVENT_LOG": "all"}).event_log == "all"


async def test_a_dead_letter_ends_the_delivery_and_is_shown(settings, r):
    keys = settings.keys
    scripts = Scripts(r, EventLog())
    await ensure_group(r, keys.requests, WORKERS_GROUP)
    entry = (await r.xadd(keys.requests, {"rid": "dead-1", "data": b"x"})).decode()
    await r.xreadgroup(WORKERS_GROUP, "w1", {keys.requests: ">"})
    letter = DeadLetter(stream=keys.requests, entry_id=entry, reason="engine error:\tboom", source="worker",
                        fields={b"rid": b"dead-1", b"data": b"x"}, deliveries=3)
    assert (await scripts.dead_letter(dead_key=keys.dead, group=WORKERS_GROUP, consumer="w1", letter=letter)).done
    t = await request_timeline(r, keys, "dead-1")
    (d,) = t.deliveries
    assert (d.worker, d.ended) == ("w1", "dead-lettered")
    (dl,) = t.dead_letters
    assert (dl.entry, dl.source, dl.by, dl.deliveries, dl.reason) == (entry, "worker", "w1", 3, "engine error: boom")
    assert t.submitted is not None and t.submitted.entry == entry  # (from the event that names the entry)
    assert any("dead letter" == step for _, step, _ in timeline_rows(t))
