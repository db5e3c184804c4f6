"""Checkpoint parts between consolidations: save_parts.lua, the consolidating append of the parts
(checkpoint_many.lua's prior parts), reading them back (shared/checkpoint_reads.py) and a worker's
saver consolidating by age (real redis-server)."""

from __future__ import annotations

import asyncio

from redroll.engine_worker import checkpoints as checkpoints_module
from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.producer import Producer
from redroll.producer.client import make_request
from redroll.shared.checkpoint_reads import load_checkpoint, parse_checkpoint
from redroll.shared.checkpoint_saves import CheckpointSave, PartSave, checkpoint_outcomes
from redroll.shared.chunks import Part, chunks_by_request, encode_part
from redroll.shared.keys import WORKERS_GROUP
from redroll.shared.scripts import Scripts
from redroll.shared.streams import ensure_group
from tests.conftest import running, wait_until


def part_of(ids: list[int], worker: str = "owner") -> bytes:
    return encode_part(Part(token_ids=ids, weight_version="v", worker=worker))


async def delivered(r, keys, *rids: str, consumer: str = "owner") -> list[str]:
    await ensure_group(r, keys.requests, WORKERS_GROUP)
    entries = [(await r.xadd(keys.requests, {"rid": rid, "data": b"x"})).decode() for rid in rids]
    await r.xreadgroup(WORKERS_GROUP, consumer, {keys.requests: ">"})
    return entries


def parts_call(scripts, r, keys, parts, consumer: str = "owner", keep_ms: int = 60_000):
    return scripts.save_parts_in(r, group=WORKERS_GROUP, consumer=consumer, parts_key=keys.parts(consumer),
                                 parts=parts, keep_ms=keep_ms, parts_ttl_s=120, chunks_ttl_s=600)


async def test_one_call_adds_its_parts_as_one_entry_fenced_and_each_refusal_its_own(settings, r):
    keys = settings.keys
    scripts = Scripts(r)
    a, b, c = await delivered(r, keys, "a", "b", "c")
    chunks = keys.tag + ":chunks:prod"
    wrong = keys.tag + ":chunks:hashy"
    await r.hset(wrong, "x", "y")
    pa, pb, pc = part_of([1, 2]), part_of([3]), part_of([4, 5, 6])
    reply = await parts_call(scripts, r, keys, [
        PartSave(requests_key=keys.requests, entry_id=a, request_id="a", before=10, adding=2, part=pa),
        PartSave(requests_key=keys.requests, entry_id=b, request_id="b", before=0, adding=1, part=pb,
                 chunks_key=chunks, refresh_ttl=False),
        PartSave(requests_key=keys.requests, entry_id=c, request_id="c", before=0, adding=3, part=pc,
                 chunks_key=wrong)])
    outcomes = checkpoint_outcomes(reply)
    assert outcomes[0] == (1, 0) and outcomes[1] == (1, 0)
    assert outcomes[2][0] == 2 and "WRONGTYPE" in outcomes[2][1]  # (its chunk stream: only it is refused)
    (entry,) = await r.xrange(keys.parts("owner"))
    assert chunks_by_request(entry[1]) == {f"{a} a": [(10, pa)], f"{b} b": [(0, pb)]}  # (the entry id first)
    (chunk,) = await r.xrange(chunks)
    assert chunks_by_request(chunk[1]) == {"b": [(0, pb)]}  # (the streamed part is also its chunk)
    assert 0 < await r.ttl(keys.parts("owner")) <= 120 and 0 < await r.ttl(chunks) <= 600
    # Another consumer's parts of these entries are fenced: nothing of them is written.
    reply = await parts_call(scripts, r, keys, [
        PartSave(requests_key=keys.requests, entry_id=a, request_id="a", before=12, adding=1, part=pb)],
        consumer="intruder")
    assert checkpoint_outcomes(reply) == [(0, "fenced")] and not await r.exists(keys.parts("intruder"))


async def test_a_parts_stream_of_another_type_refuses_every_part_and_takes_its_chunks_back(settings, r):
    keys = settings.keys
    scripts = Scripts(r)
    a, b = await delivered(r, keys, "a", "b")
    chunks = keys.tag + ":chunks:prod"
    await r.set(keys.parts("owner"), "not a stream")
    reply = await parts_call(scripts, r, keys, [
        PartSave(requests_key=keys.requests, entry_id=e, request_id=rid, before=0, adding=1, part=part_of([1]),
                 chunks_key=chunks) for e, rid in ((a, "a"), (b, "b"))])
    assert all(code == 2 and "WRONGTYPE" in detail for code, detail in checkpoint_outcomes(reply))
    assert await r.xlen(chunks) == 0  # (the chunk entry the call had added is taken out again)
    assert await r.get(keys.parts("owner")) == b"not a stream"


async def test_the_parts_stream_drops_parts_by_age(settings, r):
    keys = settings.keys
    scripts = Scripts(r)
    (a,) = await delivered(r, keys, "a")
    await r.xadd(keys.parts("owner"), {"a 0 1": part_of([1])}, id="1000-0")  # (a part from long ago)
    for i in range(150):  # (MINID ~ trims whole nodes of the stream: enough entries for one)
        await r.xadd(keys.parts("owner"), {f"a {i + 1} 1": part_of([1])}, id=f"{2000 + i}-0")
    await parts_call(scripts, r, keys, [PartSave(requests_key=keys.requests, entry_id=a, request_id="a",
                                                 before=151, adding=1, part=part_of([1]))], keep_ms=5_000)
    first = await r.xrange(keys.parts("owner"), count=1)
    assert first[0][0] != b"1000-0" and await r.xlen(keys.parts("owner")) < 152


async def test_a_consolidation_appends_the_parts_before_its_own_and_the_reader_takes_what_follows(settings, r):
    keys = settings.keys
    scripts = Scripts(r)
    (entry,) = await delivered(r, keys, "rq")
    key = keys.partial("rq")

    async def consolidate(saved: int, prior: list[bytes], prior_tokens: int, part: bytes, adding: int, length=None):
        reply = await scripts.checkpoint_many_in(r, group=WORKERS_GROUP, consumer="owner", ttl_s=60, saves=[
            CheckpointSave(requests_key=keys.requests, partial_key=key, entry_id=entry, saved=saved, adding=adding,
                           part=part, prior=b"".join(prior), prior_tokens=prior_tokens, length=length)])
        return checkpoint_outcomes(reply)[0]

    async def parts(*items: tuple[int, bytes, int]):
        reply = await parts_call(scripts, r, keys, [
            PartSave(requests_key=keys.requests, entry_id=entry, request_id="rq", before=before, adding=n, part=p)
            for before, p, n in items])
        assert all(code == 1 for code, _ in checkpoint_outcomes(reply))

    first = part_of([1, 2])
    assert await consolidate(0, [], 0, first, 2) == (1, 2)
    await parts((0, first, 2))  # (a consolidating save's part goes to the parts stream too)
    p2, p3, p4 = part_of([3]), part_of([4, 5]), part_of([6])
    await parts((2, p2, 1))
    await parts((3, p3, 2))
    cp = await load_checkpoint(r, keys, "rq", entry)
    assert cp.kept == 2 and cp.token_ids == [1, 2, 3, 4, 5] and cp.later == [p2, p3]
    # A save sent again after its reply was lost (the same start, more tokens): the later one counts.
    p3b = part_of([4, 5, 9])
    await parts((3, p3b, 3), (6, p4, 1))
    cp = await load_checkpoint(r, keys, "rq", entry)
    assert cp.token_ids == [1, 2, 3, 4, 5, 9, 6] and cp.later == [p2, p3b, p4]
    # The parts go into the key with the next consolidation, before its own part.
    length = len(await r.get(key))
    p5 = part_of([7])
    assert await consolidate(2, cp.later, 5, p5, 1, length) == (1, 8)
    await parts((7, p5, 1))
    raw = await r.get(key)
    assert parse_checkpoint(raw).token_ids == [1, 2, 3, 4, 5, 9, 6, 7]
    cp = await load_checkpoint(r, keys, "rq", entry)
    assert cp.kept == 8 and cp.later == [] and cp.tokens == 8  # (the parts before it are not read again)
    # A gap (a part lost) ends what is taken: the tokens after it are not the continuation of these.
    await parts((9, part_of([8]), 1))
    assert (await load_checkpoint(r, keys, "rq", entry)).tokens == 8
    assert await load_checkpoint(r, keys, "rq", "1-1") is None  # (another entry's checkpoint: start over)


async def test_a_worker_saves_parts_between_consolidations_and_consolidates_them_by_age(settings, r, monkeypatch):
    s = settings.with_(checkpoint_tokens=5, checkpoint_interval_s=0.0, checkpoint_min_new_tokens=10)
    request = make_request(request_id="aged", input_ids=[1, 2, 3], resumable=True,
                           sampling_params={"max_new_tokens": 400, "sampling_seed": 3})
    worker = Worker(s, SyntheticEngine(token_ms=5), max_inflight=4, block_ms=100, name="w")
    monkeypatch.setattr(checkpoints_module, "CONSOLIDATE_S", 1000.0)
    async with running(worker), Producer(s) as p:
        future = await p.submit(request)
        await wait_until(lambda: worker.stats.checkpoints >= 6, 10)
        cp = await load_checkpoint(r, s.keys, "aged")
        # Its first save went into the key; the ones after it are parts only.
        assert cp is not None and cp.kept < cp.tokens and cp.later
        # In the worker's parts stream: the first save's marker (its field, no part), then the parts.
        fields = [f for _, entry in await r.xrange(s.keys.parts("w")) for f in entry.items()]
        mine = [(name.decode().split(), value) for name, value in fields if name.startswith(cp.entry_id.encode())]
        assert mine[0] == ([cp.entry_id, "aged", "0", str(cp.kept)], b"")
        assert [value for _, value in mine[1:len(cp.later) + 1]] == cp.later
        monkeypatch.setattr(checkpoints_module, "CONSOLIDATE_S", 0.2)
        await wait_until(lambda: _kept_beyond(r, s, cp.tokens), 10)
        record = await asyncio.wait_for(future, 20)
    assert len(record.output_token_ids[0]) == 400
    assert not await r.exists(s.keys.partial("aged"))  # (the finish deleted the key; its parts age out)
    # With event_log=incidents, a first delivery's checkpoints are its normal course: no log begun.
    assert s.event_log == "incidents" and not await r.exists(s.keys.events("aged"))


async def _kept_beyond(r, s, tokens: int) -> bool:
    raw = await r.get(s.keys.partial("aged"))
    cp = parse_checkpoint(raw) if raw else None
    return cp is not None and cp.kept > tokens


def test_a_checkpoint_saved_seldom_waits_for_the_beat_and_a_frequent_one_does_not():
    from types import SimpleNamespace

    from redroll.engine_worker.checkpoints import Saver
    from redroll.engine_worker.engines.base import EngineCapabilities, SampleOutput
    from redroll.shared.settings import Settings

    settings = Settings(checkpoint_tokens=1, checkpoint_interval_s=0.0)
    ctx = SimpleNamespace(settings=settings, engine=SimpleNamespace(
        info=SimpleNamespace(weight_version="v"), partial=lambda handle: SampleOutput([1, 2, 3], None, None)),
        capabilities=EngineCapabilities(partial_output=True), tokenizer=None, name="w",
        part_of={"s": settings.keys})
    request = make_request(request_id="b", input_ids=[1], resumable=True, sampling_params={"max_new_tokens": 99})
    flight = SimpleNamespace(handle="h", stream="s", entry_id="1-0", taken_back=False, handed_back=False)

    async def due(since_last_save: float, checkpoint_beat: bool):
        saver = Saver(SimpleNamespace(ctx=ctx, writer=None), flight, request, None)
        now = saver.last_save + since_last_save
        return saver.due(now, checkpoint_beat=checkpoint_beat)

    assert asyncio.run(due(1.0, checkpoint_beat=False)) is None  # (saved seldom: it waits for the beat)
    on_beat = asyncio.run(due(1.0, checkpoint_beat=True))
    assert on_beat is not None and on_beat.save is not None and on_beat.end == 3  # (its first: consolidating)
    assert asyncio.run(due(0.1, checkpoint_beat=False)) is not None  # (saved often: each tick)
