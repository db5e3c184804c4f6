"""Streamed requests (``stream``) through Redis: chunks while the request generates, every token
once and in order, each chunk saved as a checkpoint part in the same write, the last chunk made
from the record; the refusals that name their field."""

from __future__ import annotations

import asyncio

import pytest

from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.producer.client import Producer
from redroll.producer.request import make_request
from redroll.producer.stream_reader import StreamAssembler
from redroll.shared.chunks import Part, chunks_by_request, part_of
from redroll.shared.codec import ValidationError, decode_request, encode_request
from redroll.shared.keys import Keys, chunks_key_for
from redroll.shared.types import STREAM_SCHEMA_VERSION, RecordStatus
from tests.conftest import running


def _joined(chunks):
    ids = [t for c in chunks for t in c.token_ids]
    text = "".join(c.text or "" for c in chunks)
    return ids, text


async def test_a_streamed_request_arrives_in_chunks_every_token_once(settings, r):
    s = settings.with_(stream_chunk_tokens=4, stream_chunk_ms=10_000)
    worker = Worker(s, SyntheticEngine(token_ms=5), max_inflight=4, block_ms=200)
    async with running(worker), Producer(s, block_ms=200) as producer:
        chunks = [c async for c in producer.stream(request_id="s-1", prompt="hello",
                                                   sampling_params={"max_new_tokens": 40}, return_logprob=True,
                                                   timeout=60)]
        record = chunks[-1].record
        assert record is not None and record.status is RecordStatus.FINISHED
        assert chunks[-1].finish_reason == "length" and all(c.record is None for c in chunks[:-1])
        assert len(chunks) >= 5  # incremental: several chunks came before the record
        offsets = [c.offset for c in chunks]
        ids, text = _joined(chunks)
        assert ids == record.output_token_ids[0] and text == record.output_text[0]
        assert offsets == [sum(len(c.token_ids) for c in chunks[:i]) for i in range(len(chunks))]
        assert [x for c in chunks for x in c.logprobs] == record.output_logprobs[0]
        # K tokens, whichever first: no chunk before the last two has fewer than 4 tokens (T is far away)
        assert all(len(c.token_ids) >= 4 for c in chunks[:-2])
        # the producer's chunk stream: one entry per worker call, a field per saved part, expiring
        key = s.keys.chunks(producer.name)
        entries = await r.xrange(key)
        assert entries and 0 < await r.ttl(key) <= s.stream_chunk_ttl_s
        parts = [c for _, f in entries for c in chunks_by_request(f)["s-1"]]
        assert [off for off, _ in parts] == offsets[:len(parts)]
        assert [part_of(data).token_ids for _, data in parts] == [c.token_ids for c in chunks[:len(parts)]]
        assert not await r.exists(s.keys.partial("s-1"))  # (the finish deleted the checkpoint)


async def test_chunks_come_every_t_ms_when_tokens_are_slow(settings):
    s = settings.with_(stream_chunk_tokens=1000, stream_chunk_ms=30)
    worker = Worker(s, SyntheticEngine(token_ms=20), max_inflight=2, block_ms=200)
    async with running(worker), Producer(s, block_ms=200) as producer:
        chunks = [c async for c in producer.stream(request_id="t-1", prompt="x",
                                                   sampling_params={"max_new_tokens": 30}, timeout=60)]
        assert len(chunks) >= 5 and chunks[-1].record.ok
        assert _joined(chunks)[0] == chunks[-1].record.output_token_ids[0]


async def test_many_streams_share_one_read_and_each_reader_sees_every_token_once(settings):
    """A worker writes its streams' chunks of one tick in one call; the producer reads all its
    streams with one blocking XREAD, woken once per batch, not once per chunk."""
    from redroll.producer.stream_reader import ChunkReads

    s = settings.with_(stream_chunk_tokens=1000, stream_chunk_ms=40)
    worker = Worker(s, SyntheticEngine(token_ms=10), max_inflight=16, block_ms=200)
    async with running(worker), Producer(s, block_ms=200) as producer:
        async def one(i: int):
            return [c async for c in producer.stream(request_id=f"m-{i}", prompt="x",
                                                     sampling_params={"max_new_tokens": 60}, timeout=60)]

        streams = await asyncio.gather(*(one(i) for i in range(12)))
        reads = ChunkReads.of(producer._stream_reads(), s.keys.chunks(producer.name))
        entries = await producer.redis.xrange(s.keys.chunks(producer.name))
    for chunks in streams:
        assert _joined(chunks)[0] == chunks[-1].record.output_token_ids[0]
        assert [c.offset for c in chunks] == [sum(len(c.token_ids) for c in chunks[:i]) for i in range(len(chunks))]
    written = worker.stats.checkpoints
    writer = worker._requests.checkpoints.writer
    assert written >= 12 * 5 and writer.calls * 4 <= written  # (the streams' timers beat together)
    assert 0 < reads.reads * 3 <= written
    # one entry per worker call: a call's chunks of the twelve streams travel together
    assert len(entries) == writer.calls and max(len(f) for _, f in entries) >= 6


async def test_a_stream_refuses_n_above_1_and_a_missing_reply_stream_naming_the_field(settings):
    with pytest.raises(ValidationError) as exc:
        encode_request(make_request(request_id="n4", prompt="x", stream=True, reply_to="{redroll}:reply:p",
                                    sampling_params={"n": 4}))
    assert exc.value.field == "sampling_params.n"
    with pytest.raises(ValidationError) as exc:
        encode_request(make_request(request_id="nr", prompt="x", stream=True))
    assert exc.value.field == "reply_to"
    # the field bumps the schema version: a worker that knows only v2 hands it back
    req = decode_request(encode_request(make_request(request_id="v", prompt="x", stream=True,
                                                     reply_to="{redroll}:reply:p")))
    assert req.v == STREAM_SCHEMA_VERSION == 3 and req.stream


def test_the_chunk_key_is_the_producers_own():
    k = Keys("ns")
    assert chunks_key_for(k.reply("p1")) == k.chunks("p1") == "{ns}:chunks:p1"
    assert chunks_key_for(k.results) is None


def test_the_assembler_drops_what_the_reader_has_and_ends_with_the_record():
    from redroll.shared.types import CompletionRecord

    a = StreamAssembler("r")
    first = a.take(0, Part(token_ids=[1, 2], text=" a b", worker="w"))
    assert first is not None and first.offset == 0
    assert a.take(0, Part(token_ids=[1, 2], text=" a b", worker="w2")) is None  # (a part it has)
    assert a.take(5, Part(token_ids=[9], text=" z", worker="w")) is None  # (not next)
    rec = CompletionRecord(request_id="r", status=RecordStatus.FINISHED, output_token_ids=[[1, 2, 3, 4]],
                           finish_reasons=["stop"], output_text=[" a b c d"])
    last = a.last(rec)
    assert (last.offset, last.token_ids, last.text, last.finish_reason, last.record) == (2, [3, 4], " c d", "stop", rec)


CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Grüße aus 東京 😀, a queue of requests"}]


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from redroll.engine_worker.engines.tiny_checkpoint import TINY_CHAT_TEMPLATE, save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-chat"), seed=0, chat_template=TINY_CHAT_TEMPLATE)


async def test_a_worker_sigkilled_mid_stream_the_stream_continues_elsewhere_every_token_once(
        settings, r, tmp_path, chat_checkpoint):
    import os
    import signal

    from redroll.engine_worker.engines.transformers_engine import TransformersEngine
    from tests.conftest import spawn
    from tests.support.processes import stop_process

    s = settings.with_(stream_chunk_tokens=4, stream_chunk_ms=20)
    env = {"REDROLL_STREAM_CHUNK_TOKENS": "4", "REDROLL_STREAM_CHUNK_MS": "20"}
    greedy = {"max_new_tokens": 600, "temperature": 0.0, "ignore_eos": True}
    proc = spawn(s, "worker", "--engine", "transformers", "--model-path", str(chat_checkpoint), "--max-inflight", "2",
                 "--name", "doomed", log=tmp_path / "w.log", **env)
    chunks = []
    try:
        async with Producer(s, block_ms=200) as producer:
            stream = producer.stream(request_id="kill-1", messages=CHAT, sampling_params=greedy, timeout=180)
            async for chunk in stream:
                chunks.append(chunk)
                if len(chunks) == 3:  # the stream has begun: kill its worker mid-generation
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()
                    survivor = Worker(s, TransformersEngine(str(chat_checkpoint)), max_inflight=2, block_ms=100,
                                      name="survivor")
                    survivor_run = running(survivor)
                    await survivor_run.__aenter__()
            try:
                # the same chat, uninterrupted, on the survivor
                clean = await producer.generate(request_id="clean-1", messages=CHAT, sampling_params=greedy,
                                                timeout=180)
            finally:
                await survivor_run.__aexit__(None, None, None)
    finally:
        if proc.poll() is None:
            stop_process(proc)
    record = chunks[-1].record
    ids, text = _joined(chunks)
    assert record.ok and clean.ok
    assert ids == record.output_token_ids[0] == clean.output_token_ids[0]  # no token twice, none missing
    assert text == record.output_text[0] == clean.output_text[0]
    assert [c.offset for c in chunks] == [sum(len(c.token_ids) for c in chunks[:i]) for i in range(len(chunks))]
    segments = record.meta_info["segments"]
    assert [seg["worker"] for seg in segments] == ["doomed", "survivor"]
    # chunks came from both workers: what the doomed one saved, then the survivor's own
    assert len(chunks) > 4 and segments[0]["tokens"] >= sum(len(c.token_ids) for c in chunks[:3])


class _Bytes:
    """A byte-level detokenizer: token t is byte t (an incomplete UTF-8 character decodes to U+FFFD)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_a_chunk_ends_only_where_the_text_is_settled():
    from redroll.engine_worker.settled_text import settled

    tok = _Bytes()
    req = make_request(request_id="h", prompt="x", stream=True, sampling_params={"stop": ["END"]})
    ids = list("ab".encode()) + list("é".encode())[:1]  # "ab" + half of "é"
    assert settled(tok, req, ids, 0, "") == settled(tok, req, ids[:2], 0, "")  # the half waits
    assert settled(tok, req, ids, 0, "").tokens == 2
    whole = list("abé".encode())
    assert settled(tok, req, whole, 2, "ab").text == "abé"
    # text that may begin a stop string waits; a stop string in the text is never sent
    assert settled(tok, req, list(b"abEN"), 0, "").text == "ab"
    assert settled(tok, req, list(b"abENx"), 0, "").text == "abENx"
    assert settled(tok, req, list(b"abEND"), 0, "").tokens == 2
    # an input_ids request that wants no text and has no stop strings: every token at once
    plain = make_request(request_id="p", input_ids=[1], stream=True)
    assert settled(tok, plain, [0xC3], 0, "").tokens == 1


async def test_a_streamed_stop_string_never_shows_in_a_chunk(settings):
    s = settings.with_(stream_chunk_tokens=1, stream_chunk_ms=1)
    worker = Worker(s, SyntheticEngine(token_ms=3), max_inflight=2, block_ms=200)
    async with running(worker), Producer(s, block_ms=200) as producer:
        free = await producer.generate(request_id="free", prompt="abc", sampling_params={"max_new_tokens": 60,
                                                                                         "sampling_seed": 3})
        words = free.output_text[0].split(" ")
        stop = " " + " ".join(words[20:22])  # two words well inside the output
        chunks = [c async for c in producer.stream(request_id="stopped", prompt="abc", timeout=60,
                                                   sampling_params={"max_new_tokens": 60, "sampling_seed": 3,
                                                                    "stop": [stop]})]
    record = chunks[-1].record
    assert record.finish_reasons == ["stop"] and chunks[-1].finish_reason == "stop"
    assert _joined(chunks)[1] == record.output_text[0] == free.output_text[0][:free.output_text[0].index(stop)]
    assert all(stop not in (c.text or "") for c in chunks) and len(chunks) > 3


# ---------------------------------------------------------------- streams under narrowed ACL users

from tests import test_security  # noqa: E402

acl_server, admin = test_security.acl_server, test_security.admin  # (a server with ACL users)


async def test_streams_stay_with_their_producer_under_narrowed_acl_users(acl_server, admin):
    import uuid

    import redis.exceptions

    from redroll.shared.connection import connect
    from redroll.shared.settings import Settings
    from tests.conftest import wait_until
    from tests.test_security import make_user

    ns = "st" + uuid.uuid4().hex[:8]
    keys = Settings(namespace=ns).keys
    p1_s = make_user(admin, acl_server, ns, "producer", producer="p1").with_(stream_chunk_tokens=2)
    p2_s = make_user(admin, acl_server, ns, "producer", producer="p2").with_(stream_chunk_tokens=2)
    work_s = make_user(admin, acl_server, ns, "worker").with_(stream_chunk_tokens=2, stream_chunk_ms=5)
    slow = {"max_new_tokens": 400}
    async with running(Worker(work_s, SyntheticEngine(token_ms=2), max_inflight=4, block_ms=100)), \
            Producer(p2_s, name="p2", block_ms=100) as p2, Producer(p1_s, name="p1", block_ms=100) as p1:
        # p1 streams as its own user: it reads its own chunk stream
        mine = [c async for c in p1.stream(request_id="mine", prompt="x", sampling_params={"max_new_tokens": 30},
                                           timeout=60)]
        assert len(mine) > 2 and mine[-1].record.ok
        victim = p2.stream(request_id="victim", prompt="genuine", sampling_params=slow, timeout=60)
        first = await victim.__anext__()
        assert first.offset == 0
        # p1 may not read p2's chunks ...
        c1 = connect(p1_s)
        try:
            with pytest.raises(redis.exceptions.NoPermissionError):
                await c1.xrange(keys.chunks("p2"))
            # ... nor have a worker write into them: an entry of its own naming p2's reply stream and
            # p2's live request_id streams nothing there (the ownership check), and is dead-lettered
            forged = make_request(request_id="victim", prompt="forged", stream=True, sampling_params=slow)
            forged.reply_to = keys.reply("p2")
            await c1.xadd(keys.requests_high, encode_request(forged, p1_s.limits))
            await wait_until(lambda: admin.xlen(keys.dead) >= 1, 30)
        finally:
            await c1.aclose()
        rest = [c async for c in victim]
    chunks = [first, *rest]
    record = chunks[-1].record
    assert record.ok and _joined(chunks)[1] == record.output_text[0]
    assert [c.offset for c in chunks] == [sum(len(c.token_ids) for c in chunks[:i]) for i in range(len(chunks))]


def test_the_sync_producer_streams_as_a_plain_iterator(settings):
    import threading

    from redroll.producer.sync import SyncProducer

    s = settings.with_(stream_chunk_tokens=2)
    loop = asyncio.new_event_loop()
    worker = Worker(s, SyntheticEngine(token_ms=3), max_inflight=2, block_ms=100)
    thread = threading.Thread(target=loop.run_until_complete, args=(worker.run(),), daemon=True)
    thread.start()
    try:
        with SyncProducer(s, block_ms=100) as producer:
            chunks = list(producer.stream(request_id="sync-1", prompt="x", sampling_params={"max_new_tokens": 20},
                                          timeout=60))
    finally:
        loop.call_soon_threadsafe(worker.request_stop)
        thread.join(30)
    assert len(chunks) > 2 and chunks[-1].record.ok
    assert [t for c in chunks for t in c.token_ids] == chunks[-1].record.output_token_ids[0]


async def test_chunks_carry_logprobs_and_top_logprobs_equal_to_the_records(settings, chat_checkpoint):
    from redroll.engine_worker.engines.transformers_engine import TransformersEngine

    s = settings.with_(stream_chunk_tokens=4, stream_chunk_ms=10)
    worker = Worker(s, TransformersEngine(str(chat_checkpoint)), max_inflight=2, block_ms=100)
    async with running(worker), Producer(s, block_ms=100) as producer:
        chunks = [c async for c in producer.stream(request_id="top-1", messages=CHAT, return_logprob=True,
                                                   top_logprobs_num=3, timeout=120,
                                                   sampling_params={"max_new_tokens": 48, "ignore_eos": True})]
    record = chunks[-1].record
    assert record.ok and len(chunks) > 2
    assert [x for c in chunks for x in c.logprobs] == record.output_logprobs[0]
    assert [list(map(tuple, t)) for c in chunks for t in c.top_logprobs] == \
        [list(map(tuple, t)) for t in record.output_top_logprobs[0]]
    assert all(c.top_logprobs is not None and len(c.top_logprobs) == len(c.token_ids) for c in chunks)
