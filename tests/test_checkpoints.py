"""Resumable requests: checkpoints saved while generating, resumed by the next worker (real redis-server)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from redroll.engine_worker.checkpoints import (
    Checkpoint,
    Part,
    encode_part,
    parse_checkpoint,
    resume_request,
    stitch_resumed,
)
from redroll.engine_worker.engines.base import EngineOutput, SampleOutput
from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.ops.gc import collect_garbage
from redroll.producer import Producer
from redroll.producer.client import make_request
from redroll.shared.checkpoint_reads import load_checkpoint
from redroll.shared.codec import ValidationError, encode_request
from redroll.shared.keys import WORKERS_GROUP
from redroll.shared.scripts import DeadLetter, Scripts
from redroll.shared.streams import ensure_group
from redroll.shared.types import RecordStatus
from tests.conftest import running, spawn, stop_process, wait_until

PROMPT = list(range(1, 9))


def checkpointing(settings, **kw):
    return settings.with_(**{"checkpoint_tokens": 20, "checkpoint_interval_s": 0.1, "checkpoint_min_new_tokens": 50,
                             **kw})


def resumable(rid: str, max_new_tokens: int = 300, **kw):
    return make_request(request_id=rid, input_ids=PROMPT, resumable=True, return_logprob=True,
                        sampling_params={"max_new_tokens": max_new_tokens, "sampling_seed": 7}, **kw)


def header(entry_id: str, count: int) -> bytes:
    return b"%-44s %018d\n" % (entry_id.encode(), count)


# ---------------------------------------------------------------- format, continuation, stitching


def test_parts_append_and_parse_back():
    raw = header("5-0", 5) + encode_part(Part(token_ids=[1, 2, 3], logprobs=[-0.1, -0.2, -0.3],
                                              weight_versions=["v1"] * 3, worker="a"))
    raw += encode_part(Part(token_ids=[4, 5], logprobs=[-0.4, -0.5], weight_versions=["v2", "v2"], worker="a"))
    cp = parse_checkpoint(raw)
    assert cp is not None and cp.entry_id == "5-0" and cp.token_ids == [1, 2, 3, 4, 5]
    assert cp.logprobs == [-0.1, -0.2, -0.3, -0.4, -0.5] and cp.weight_versions == ["v1"] * 3 + ["v2"] * 2
    assert cp.segments == [{"worker": "a", "weight_version": "v1", "tokens": 3},
                           {"worker": "a", "weight_version": "v2", "tokens": 2}]
    assert parse_checkpoint(header("5-0", 4) + raw[64:]) is None  # the count disagrees: torn
    assert parse_checkpoint(b"someone else's string") is None


def test_validation_refuses_what_cannot_resume():
    with pytest.raises(ValidationError, match="resumable"):
        encode_request(make_request(request_id="x", prompt="text", resumable=True))
    with pytest.raises(ValidationError, match="resumable"):
        encode_request(make_request(request_id="x", input_ids=[1], resumable=True, sampling_params={"n": 2}))


def test_resume_request_and_stitch_resumed():
    request = resumable("r", 10, meta_info={"k": 1})
    cp = Checkpoint(entry_id="1-0", token_ids=[5, 6, 7], logprobs=[-1.0, -1.0, -1.0], weight_versions=["v1"] * 3,
                    segments=[{"worker": "a", "weight_version": "v1", "tokens": 3}])
    cont = resume_request(request, cp)
    assert cont.input_ids == PROMPT + [5, 6, 7] and cont.sampling_params.max_new_tokens == 7
    assert cont.sampling_params.sampling_seed == 10 and cont.request_id == "r"
    out = EngineOutput(samples=[SampleOutput([8, 9], [-2.0, -2.0], "stop")], prompt_tokens=11, weight_version="v2")
    merged = stitch_resumed(cp, out, request, "b")
    sample = merged.samples[0]
    assert sample.token_ids == [5, 6, 7, 8, 9] and sample.logprobs == [-1.0] * 3 + [-2.0] * 2
    assert sample.finish_reason == "stop" and sample.weight_versions == ["v1"] * 3 + ["v2"] * 2
    assert merged.prompt_tokens == len(PROMPT) and merged.extra["resumed_from"] == 3
    assert merged.extra["segments"] == [{"worker": "a", "weight_version": "v1", "tokens": 3},
                                        {"worker": "b", "weight_version": "v2", "tokens": 2}]


# ---------------------------------------------------------------- the script


async def test_checkpoint_script_is_fenced_and_all_or_nothing(settings, r):
    keys = settings.keys
    scripts = Scripts(r)
    await ensure_group(r, keys.requests, WORKERS_GROUP)
    entry = await r.xadd(keys.requests, {"rid": "c1", "data": b"x"})
    entry = entry.decode()
    await r.xreadgroup(WORKERS_GROUP, "owner", {keys.requests: ">"})
    key = keys.partial("c1")
    part = encode_part(Part(token_ids=[1, 2], weight_versions=["v", "v"], worker="owner"))

    def call(consumer: str, saved: int, **kw):
        return scripts.checkpoint(requests_key=keys.requests, partial_key=kw.get("key", key), group=WORKERS_GROUP,
                                  consumer=consumer, entry_id=kw.get("entry", entry), saved=saved, adding=2,
                                  part=part, ttl_s=60)

    assert await call("intruder", 0) == (0, "fenced") and not await r.exists(key)
    assert await call("owner", 0) == (1, 2)
    assert await call("owner", 0) == (0, "stale")  # (a second writer that thinks nothing is saved)
    assert await call("owner", 2) == (1, 4)
    cp = parse_checkpoint(await r.get(key))
    assert cp.entry_id == entry and cp.token_ids == [1, 2, 1, 2] and 0 < await r.ttl(key) <= 60
    # A checkpoint of an earlier entry of the same request_id is replaced, never continued.
    await r.set(key, header("1-1", 2) + part)
    assert await call("owner", 2) == (0, "stale")
    assert await call("owner", 0) == (1, 2) and parse_checkpoint(await r.get(key)).entry_id == entry
    # A key of another type refuses it: nothing written.
    await r.hset(keys.partial("hashy"), "a", "b")
    code, detail = await call("owner", 0, key=keys.partial("hashy"))
    assert code == 2 and "WRONGTYPE" in detail and await r.hgetall(keys.partial("hashy")) == {b"a": b"b"}


async def test_a_writers_next_append_is_checked_by_the_checkpoints_length(settings, r):
    """A writer's saves after its first send the bytes the checkpoint held after its last one: an
    append that finds another length (another writer's parts, a deleted checkpoint) is undone."""
    from redroll.shared.scripts import CheckpointSave, checkpoint_outcomes

    keys = settings.keys
    scripts = Scripts(r)
    await ensure_group(r, keys.requests, WORKERS_GROUP)
    entry = (await r.xadd(keys.requests, {"rid": "len", "data": b"x"})).decode()
    await r.xreadgroup(WORKERS_GROUP, "owner", {keys.requests: ">"})
    key = keys.partial("len")
    part = encode_part(Part(token_ids=[1, 2], weight_versions=["v", "v"], worker="owner"))

    async def save(saved: int, length: int | None):
        reply = await scripts.checkpoint_many_in(r, group=WORKERS_GROUP, consumer="owner", ttl_s=60, saves=[
            CheckpointSave(requests_key=keys.requests, partial_key=key, entry_id=entry, saved=saved, adding=2,
                           part=part, length=length)])
        return checkpoint_outcomes(reply)[0]

    assert await save(0, None) == (1, 2)  # (its first: the header read)
    first = await r.get(key)
    assert len(first) == 64 + len(part)
    assert await save(2, len(first)) == (1, 4)  # (its next: the length sent instead)
    assert parse_checkpoint(await r.get(key)).token_ids == [1, 2, 1, 2]
    held = await r.get(key)
    await r.append(key, b"foreign")  # (bytes another writer added)
    assert await save(4, len(held)) == (0, "stale")
    assert await r.get(key) == held + b"foreign"  # (the append undone: the checkpoint as it was)
    await r.delete(key)
    assert await save(4, len(held)) == (0, "stale")
    assert not await r.exists(key)  # (not made anew from a lone part)


async def test_a_run_of_saves_keeps_one_event_line_rewritten_in_place(settings, r):
    """A delivery's run of checkpoints is one line of its request's event log, rewritten in place by
    each save (the same width: its counts padded at the end), so the log's length stays put; an
    event in between starts a new line (still counting the writer's saves), and the lines before
    the run are left as they were."""
    from redroll.shared.events import EventLog, parse_line
    from redroll.shared.keys import events_key
    from redroll.shared.scripts import CheckpointSave, checkpoint_outcomes

    keys = settings.keys
    scripts = Scripts(r, EventLog())
    await ensure_group(r, keys.requests, WORKERS_GROUP)
    entry = (await r.xadd(keys.requests, {"rid": "ev", "data": b"x"})).decode()
    await r.xreadgroup(WORKERS_GROUP, "owner", {keys.requests: ">"})
    log = events_key(keys.requests, "ev")
    await r.set(log, "1\tdelivered\tworker=earlier\n")
    part = encode_part(Part(token_ids=[1, 2], weight_versions=["v", "v"], worker="owner"))
    saved, length = 0, None

    async def save():
        nonlocal saved, length
        reply = await scripts.checkpoint_many_in(r, group=WORKERS_GROUP, consumer="owner", ttl_s=60, saves=[
            CheckpointSave(requests_key=keys.requests, partial_key=keys.partial("ev"), entry_id=entry, saved=saved,
                           adding=2, part=part, length=length, number=saved // 2 + 1)])
        assert checkpoint_outcomes(reply)[0] == (1, saved + 2)
        saved, length = saved + 2, await r.strlen(keys.partial("ev"))
        return (await r.get(log)).decode()

    first = await save()
    widths = set()
    for _ in range(11):  # (to 12 saves: the counts grow a digit, the line does not)
        text = await save()
        widths.add(len(text))
    assert widths == {len(first)}
    lines = text.splitlines()
    assert lines[0] == "1\tdelivered\tworker=earlier" and len(lines) == 2
    _, kind, fields = parse_line(lines[1])
    assert kind == "checkpoint" and fields["worker"] == "owner" and fields["entry"] == entry
    assert fields["tokens"] == "24" and fields["saves"] == "12"  # (the padding is not part of a value)
    await r.append(log, "2\tlease_lost\tworker=owner\n")  # (another event: the next save starts a new line)
    lines = (await save()).splitlines()
    assert len(lines) == 4 and parse_line(lines[1])[2]["saves"] == "12" and parse_line(lines[3])[2]["saves"] == "13"
    assert await r.ttl(log) > 0


async def test_dead_letter_and_gc_delete_checkpoints(settings, r):
    keys = settings.keys
    scripts = Scripts(r)
    await ensure_group(r, keys.requests, WORKERS_GROUP)
    entry = (await r.xadd(keys.requests, {"rid": "d1", "data": b"x"})).decode()
    await r.xreadgroup(WORKERS_GROUP, "w", {keys.requests: ">"})
    await r.set(keys.partial("d1"), header(entry, 0))
    await r.set(keys.partial("other"), header("9-9", 0))  # another request's: kept by the dead letter
    letter = DeadLetter(stream=keys.requests, entry_id=entry, reason="test", source="worker", fields={"rid": "d1"},
                        rid_key=keys.rid("d1"), partial_key=keys.partial("d1"))
    outcome = await scripts.dead_letter(dead_key=keys.dead, group=WORKERS_GROUP, consumer="w", letter=letter)
    assert outcome.done and not await r.exists(keys.partial("d1"))
    # GC: a checkpoint whose request has no de-duplication key any more is an orphan.
    live = (await r.xadd(keys.requests, {"rid": "live", "data": b"x"})).decode()  # (still queued)
    await r.set(keys.rid("live"), f"token {live}")
    await r.set(keys.partial("live"), header(live, 0))
    report = await collect_garbage(r, keys, reply_ttl_s=3600)
    assert report.checkpoints == [keys.partial("other")]
    assert await r.exists(keys.partial("live")) and not await r.exists(keys.partial("other"))


# ---------------------------------------------------------------- workers


async def test_a_drain_saves_and_the_next_worker_resumes(settings, r):
    s = checkpointing(settings, drain_timeout_s=0.2)
    a = Worker(s, SyntheticEngine(token_ms=5), max_inflight=4, block_ms=100, name="a")
    b = Worker(s, SyntheticEngine(token_ms=5), max_inflight=4, block_ms=100, name="b")
    request = resumable("long-1")
    async with Producer(s) as p:
        task = asyncio.create_task(a.run())
        future = await p.submit(request)
        await wait_until(lambda: a.stats.checkpoints >= 2, 10)
        a.request_stop()
        await asyncio.wait_for(task, 10)
        saved = parse_checkpoint(await r.get(s.keys.partial("long-1")))
        assert saved is not None and 40 <= saved.tokens < 300  # the drain's last part is in
        async with running(b):
            record = await asyncio.wait_for(future, 20)
    assert record.status is RecordStatus.FINISHED and b.stats.resumed == 1
    ids, lps = record.output_token_ids[0], record.output_logprobs[0]
    assert len(ids) == len(lps) == 300 and ids[:saved.tokens] == saved.token_ids
    segments = record.meta_info["segments"]
    assert [x["worker"] for x in segments] == ["a", "b"] and sum(x["tokens"] for x in segments) == 300
    assert record.meta_info["resumed_from"] == saved.tokens and record.meta_info["prompt_tokens"] == len(PROMPT)
    # What a saw is what a would have made: the synthetic engine's tokens for the original request.
    first, _ = SyntheticEngine().tokens_for(request, 0)
    assert ids[:saved.tokens] == first[:saved.tokens]
    assert not await r.exists(s.keys.partial("long-1"))  # the fenced finish deleted it


@pytest.mark.parametrize("stop", ["abort", "deadline"])
async def test_an_abort_or_deadline_while_the_checkpoint_loads_stops_the_request(settings, r, monkeypatch, stop):
    # (the engine ignores an abort of a handle it does not know yet: the request once ran to its
    # end and was published finished)
    from redroll.engine_worker.checkpoints import Checkpoints

    loading = asyncio.Event()
    load = Checkpoints.load
    # (the deadline leaves the worker time to claim the request on a busy machine; the load
    # outlasts it, so it passes while the checkpoint loads)
    deadline_at = time.time() + 2.0

    async def slow_load(self, *args, **kwargs):
        loading.set()
        await asyncio.sleep(0.3 if stop == "abort" else max(0.0, deadline_at - time.time()) + 0.2)  # (a large GET)
        return await load(self, *args, **kwargs)

    monkeypatch.setattr(Checkpoints, "load", slow_load)
    s = checkpointing(settings, claim_idle_ms=300)
    worker = Worker(s, SyntheticEngine(token_ms=10), max_inflight=4, block_ms=100)
    deadline = {"deadline": deadline_at} if stop == "deadline" else {}
    async with Producer(s) as p:
        future = await p.submit(resumable(f"{stop}-1", 300, **deadline))
        # (a checkpoint is looked for only when the entry is taken back: a worker that died took it first)
        await ensure_group(r, s.keys.requests, WORKERS_GROUP)
        await r.xreadgroup(WORKERS_GROUP, "died", {s.keys.requests: ">"})
        async with running(worker):
            await asyncio.wait_for(loading.wait(), 10)
            if stop == "abort":
                await p.abort(request_ids=[f"{stop}-1"])
            record = await asyncio.wait_for(future, 10)
    assert record.status is (RecordStatus.ABORTED if stop == "abort" else RecordStatus.EXPIRED)
    assert record.finish_reasons == [None] and worker.engine.tokens_decoded == 0


async def test_a_stale_checkpoint_is_not_resumed(settings, r):
    s = checkpointing(settings)
    await r.set(s.keys.partial("fresh-1"), header("1-1", 3) + encode_part(
        Part(token_ids=[1, 2, 3], weight_versions=["x"] * 3, worker="old")))
    worker = Worker(s, SyntheticEngine(token_ms=1), max_inflight=4, block_ms=100)
    async with running(worker), Producer(s) as p:
        record = await asyncio.wait_for(await p.submit(resumable("fresh-1", 60)), 10)
    assert worker.stats.resumed == 0 and "segments" not in record.meta_info
    assert len(record.output_token_ids[0]) == 60


@pytest.mark.slow
async def test_sigkill_mid_generation_resumes_elsewhere(settings, r, tmp_path):
    s = checkpointing(settings)
    env = {"REDROLL_CHECKPOINT_TOKENS": "20", "REDROLL_CHECKPOINT_INTERVAL_S": "0.1",
           "REDROLL_CHECKPOINT_MIN_NEW_TOKENS": "50"}
    proc = spawn(s, "worker", "--engine", "synthetic", "--token-ms", "10", "--max-inflight", "4",
                 log=tmp_path / "w.log", **env)
    try:
        async with Producer(s) as p:
            future = await p.submit(resumable("killed-1", 400))

            async def saved_tokens() -> int:
                cp = await load_checkpoint(r, s.keys, "killed-1")
                return cp.tokens if cp else 0
            await wait_until(lambda: _at_least(saved_tokens, 100), 30)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            killed_at = time.monotonic()
            before = await saved_tokens()
            # (what it saved last went to its parts stream only: the survivor reads it from there)
            assert parse_checkpoint(await r.get(s.keys.partial("killed-1"))).tokens < before
            survivor = Worker(s, SyntheticEngine(token_ms=10), max_inflight=4, block_ms=100, name="survivor")
            async with running(survivor):
                record = await asyncio.wait_for(future, 30)
            took = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            stop_process(proc)
    assert record.status is RecordStatus.FINISHED and record.meta_info["attempt"] >= 2
    assert record.meta_info["resumed_from"] == before and len(record.output_token_ids[0]) == 400
    last = record.meta_info["segments"][-1]
    assert last["worker"] == "survivor" and last["tokens"] == 400 - before
    assert sum(x["tokens"] for x in record.meta_info["segments"]) == 400
    assert survivor.engine.tokens_decoded == 400 - before  # only the remaining budget was decoded
    # Resuming saved the time of the tokens already made (400 x 10 ms from scratch).
    assert took < s.claim_idle_ms / 1000 + (400 - before) * 0.01 + 3.0


async def _at_least(probe, n: int) -> bool:
    return await probe() >= n


@pytest.mark.slow
async def test_sigkill_of_a_transformers_worker_resumes_unseeded_sampling(settings, r, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from redroll.engine_worker.engines.tiny_model import build_tiny_model, teacher_forced_logprobs
    from redroll.engine_worker.engines.transformers_engine import TransformersEngine

    s = checkpointing(settings)
    env = {"REDROLL_CHECKPOINT_TOKENS": "50", "REDROLL_CHECKPOINT_INTERVAL_S": "0.2",
           "REDROLL_CHECKPOINT_MIN_NEW_TOKENS": "50"}
    proc = spawn(s, "worker", "--engine", "transformers", "--model-path", "tiny-random", "--max-inflight", "2",
                 log=tmp_path / "w.log", **env)
    budget = 1000
    request = make_request(request_id="tf-1", input_ids=PROMPT, resumable=True, return_logprob=True,
                           sampling_params={"max_new_tokens": budget, "temperature": 1.0, "ignore_eos": True})
    try:
        async with Producer(s) as p:
            future = await p.submit(request)

            async def saved() -> Checkpoint | None:
                return await load_checkpoint(r, s.keys, "tf-1")

            async def enough() -> bool:
                cp = await saved()
                return cp is not None and cp.tokens >= 150
            await wait_until(enough, 60)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            cp = await saved()
            survivor = Worker(s, TransformersEngine(), max_inflight=2, block_ms=100, name="survivor")
            async with running(survivor):
                record = await asyncio.wait_for(future, 120)
    finally:
        if proc.poll() is None:
            stop_process(proc)
    ids, lps = record.output_token_ids[0], record.output_logprobs[0]
    assert record.status is RecordStatus.FINISHED and len(ids) == len(lps) == budget
    assert ids[:cp.tokens] == cp.token_ids and lps[:cp.tokens] == cp.logprobs
    segments = record.meta_info["segments"]
    assert segments[-1]["worker"] == "survivor" and segments[0]["worker"] != "survivor"
    assert [sum(x["tokens"] for x in segments[:-1]), segments[-1]["tokens"]] == [cp.tokens, budget - cp.tokens]
    assert survivor.engine.tokens_decoded == budget - cp.tokens
    # Both parts are the same model's: every logprob matches a teacher-forced recomputation.
    ref = teacher_forced_logprobs(build_tiny_model(0), PROMPT, ids, 1.0)
    assert max(abs(x - y) for x, y in zip(lps, ref)) < 1e-4


async def test_transformers_continues_greedy_output_exactly():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from redroll.engine_worker.engines.tiny_model import build_tiny_model, teacher_forced_logprobs
    from redroll.engine_worker.engines.transformers_engine import TransformersEngine
    from tests.conftest import started

    request = make_request(request_id="g", input_ids=PROMPT, resumable=True, return_logprob=True,
                           sampling_params={"max_new_tokens": 24, "temperature": 0, "ignore_eos": True})
    async with started(TransformersEngine()) as engine:
        whole = await engine.generate(request, "h1")
        head = whole.samples[0]
        cp = Checkpoint(entry_id="1-0", token_ids=head.token_ids[:10], logprobs=head.logprobs[:10],
                        weight_versions=["v"] * 10, segments=[{"worker": "a", "weight_version": "v", "tokens": 10}])
        rest = await engine.generate(resume_request(request, cp), "h2")
    merged = stitch_resumed(cp, rest, request, "b").samples[0]
    assert merged.token_ids == head.token_ids
    ref = teacher_forced_logprobs(build_tiny_model(0), PROMPT, merged.token_ids, 1.0)
    assert max(abs(x - y) for x, y in zip(merged.logprobs, ref)) < 1e-4


async def test_one_call_saves_many_and_one_refusal_changes_no_other_fate(settings, r):
    """checkpoint_many: each save fenced and all-or-nothing by itself, in one call."""
    from redroll.shared.keys import chunks_key_for, owner_key_for
    from redroll.shared.scripts import CheckpointSave, checkpoint_outcomes

    keys = settings.keys
    scripts = Scripts(r)
    await ensure_group(r, keys.requests, WORKERS_GROUP)
    await ensure_group(r, keys.requests_high, WORKERS_GROUP)
    reply = keys.reply("prod")
    entries = {}
    for rid in ("ok", "other", "stale", "typed", "chunked", "forged", "exhausted"):
        stream = keys.requests_high if rid == "ok" else keys.requests
        entries[rid] = (stream, (await r.xadd(stream, {"rid": rid, "data": b"x"})).decode())
    await r.xreadgroup(WORKERS_GROUP, "me", {keys.requests: ">", keys.requests_high: ">"})
    await r.xclaim(keys.requests, WORKERS_GROUP, "someone", 0, [entries["other"][1]])
    await r.set(keys.partial("stale"), header(entries["stale"][1], 5))
    await r.hset(keys.partial("typed"), "a", "b")
    exhausted = keys.reply("prod2")  # (another producer, whose chunk stream takes no more entries)
    await r.hset(owner_key_for(reply), "chunked", f"requests {entries['chunked'][1]}")
    await r.hset(owner_key_for(exhausted), "exhausted", f"requests {entries['exhausted'][1]}")
    # (a chunk stream whose ids are exhausted, beside a checkpoint of the same entry: continued, not started over)
    await r.xadd(chunks_key_for(exhausted), {"x": "1"}, id="18446744073709551615-18446744073709551615")
    await r.set(keys.partial("exhausted"), header(entries["exhausted"][1], 0) + b"older")
    part = encode_part(Part(token_ids=[1, 2], weight_versions=["v", "v"], worker="me"))

    def save(rid: str, chunked: bool = False) -> CheckpointSave:
        stream, entry = entries[rid]
        to = exhausted if rid == "exhausted" else reply
        return CheckpointSave(requests_key=stream, partial_key=keys.partial(rid), entry_id=entry, saved=0, adding=2,
                              part=part, chunks_key=chunks_key_for(to) if chunked else None,
                              owner_key=owner_key_for(to) if chunked else None)

    saves = [save("ok"), save("other"), save("stale"), save("typed"), save("chunked", True), save("forged", True),
             save("exhausted", True)]
    outcomes = checkpoint_outcomes(await scripts.checkpoint_many_in(r, group=WORKERS_GROUP, consumer="me",
                                                                    saves=saves, ttl_s=60, chunks_ttl_s=60))
    assert outcomes[:3] == [(1, 2), (0, "fenced"), (0, "stale")]
    assert outcomes[3][0] == 2 and "WRONGTYPE" in outcomes[3][1]
    assert outcomes[4] == (1, 2)
    assert outcomes[5][0] == 2 and "ownership check failed" in outcomes[5][1]
    assert outcomes[6][0] == 2  # (its chunk stream takes no more entries: nothing of it written)
    assert parse_checkpoint(await r.get(keys.partial("ok"))).token_ids == [1, 2]
    assert parse_checkpoint(await r.get(keys.partial("chunked"))).token_ids == [1, 2]
    (_, fields), = await r.xrange(chunks_key_for(reply))  # (one entry: the chunked save's only; not the forged one's)
    assert fields == {b"chunked 0 2": part}
    for rid in ("other", "forged"):
        assert not await r.exists(keys.partial(rid))
    # (the refused XADD put the checkpoint back as it was, byte for byte)
    assert await r.get(keys.partial("exhausted")) == header(entries["exhausted"][1], 0) + b"older"
    assert await r.get(keys.partial("stale")) == header(entries["stale"][1], 5)
    assert 0 < await r.ttl(keys.partial("ok")) <= 60


async def test_a_worker_saves_all_its_requests_in_one_call_a_tick(settings, r):
    s = checkpointing(settings, checkpoint_tokens=5, checkpoint_interval_s=0.0)
    worker = Worker(s, SyntheticEngine(token_ms=2), max_inflight=32, block_ms=100)
    async with running(worker), Producer(s) as p:
        futures = [await p.submit(resumable(f"many-{i}", 200)) for i in range(16)]
        records = await asyncio.wait_for(asyncio.gather(*futures), 30)
    assert all(len(rec.output_token_ids[0]) == 200 for rec in records)
    writer = worker._requests.checkpoints.writer
    # Every request was saved several times, in far fewer round trips than saves.
    assert writer.saves == worker.stats.checkpoints >= 16 * 3
    assert writer.calls * 4 <= writer.saves
