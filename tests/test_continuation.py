"""Continuation by the worker's ``continuation`` setting (engine_worker/checkpoints.py): which
requests continue from their saved tokens after a hand-back, and which start over (real
redis-server, in-process workers)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from redroll.engine_worker.checkpoints import Saver, starts_over
from redroll.engine_worker.engines.base import EngineCapabilities, SampleOutput
from redroll.engine_worker.engines.synthetic import SyntheticEngine, SyntheticWords
from redroll.engine_worker.worker import Worker
from redroll.producer import Producer
from redroll.producer.client import make_request
from redroll.shared.checkpoint_reads import load_checkpoint
from redroll.shared.settings import Settings
from redroll.shared.types import RecordStatus
from tests.conftest import running, wait_until

WORDS = SyntheticWords()
TOKENS = 400


def test_what_continues_and_what_starts_over():
    s = Settings()
    tok = WORDS
    ok = make_request(request_id="a", messages=[{"role": "user", "content": "hi"}])
    assert starts_over(ok, s, tok) is None
    assert starts_over(make_request(request_id="a", prompt="x"), s, tok) is None
    assert "tokenizer" in starts_over(make_request(request_id="a", prompt="x"), s, None)
    assert starts_over(make_request(request_id="a", input_ids=[1]), s, None) is None
    assert "n > 1" in starts_over(make_request(request_id="a", input_ids=[1], sampling_params={"n": 2}), s, tok)
    for key in ("json_schema", "regex", "ebnf", "structural_tag"):
        why = starts_over(make_request(request_id="a", input_ids=[1], sampling_params={key: "x"}), s, tok)
        assert why is not None and key in why and "grammar" in why
        # (an engine that advances its grammar over the saved tokens continues it: the transformers engine)
        assert starts_over(make_request(request_id="a", input_ids=[1], sampling_params={key: "x"}), s, tok,
                           grammar_resume=True) is None
    assert "stop_regex" in starts_over(make_request(request_id="a", input_ids=[1],
                                                    sampling_params={"stop_regex": "x"}), s, tok)
    assert "penalty" in starts_over(make_request(request_id="a", input_ids=[1],
                                                 sampling_params={"frequency_penalty": 0.5}), s, tok)
    assert "logprob_start_len" in starts_over(make_request(request_id="a", input_ids=[1, 2], return_logprob=True,
                                                           logprob_start_len=0), s, tok)
    off = s.with_(continuation=False)
    assert starts_over(ok, off, tok) == "continuation is off"
    # A streamed request always continues (its reader has its tokens), so does a resumable one.
    assert starts_over(make_request(request_id="a", input_ids=[1], resumable=True), off, tok) is None
    assert starts_over(make_request(request_id="a", prompt="x", stream=True, reply_to="{redroll}:reply:p"),
                       off, tok) is None


def test_a_save_never_ends_inside_a_stop_string():
    """A request with stop strings is saved only as far as its text is settled: a continuation then
    sees every stop string whole in its own output (the engine checks stop strings in what it makes)."""
    request = make_request(request_id="s", prompt="x", sampling_params={"stop": [" queue worker token"]})
    ctx = SimpleNamespace(settings=Settings(), engine=SimpleNamespace(info=SimpleNamespace(weight_version="v")),
                          capabilities=EngineCapabilities(partial_output=True, tokenizer=True), tokenizer=WORDS,
                          name="w", part_of={"s": Settings().keys})
    saver = Saver(SimpleNamespace(ctx=ctx, writer=None), SimpleNamespace(handle="h", stream="s", entry_id="1-0", taken_back=False, handed_back=False),
                  request, None)
    # " the queue worker": the last two words may begin the stop string, so they wait.
    prepared = asyncio.run(_prepare(saver, SampleOutput([0, 1, 2], None, None)))
    assert prepared.end == 1 and parse_part_ids(prepared) == [0]
    # " the redis ...": settled, all of it.
    saver = Saver(SimpleNamespace(ctx=ctx, writer=None), SimpleNamespace(handle="h", stream="s", entry_id="1-0", taken_back=False, handed_back=False),
                  request, None)
    prepared = asyncio.run(_prepare(saver, SampleOutput([0, 14, 0], None, None)))
    assert prepared.end == 3


async def _prepare(saver, sample):
    return saver.prepare(sample)


def parse_part_ids(prepared) -> list[int]:
    from redroll.shared.chunks import decode_part

    return decode_part(prepared.save.part[8:]).token_ids


async def test_a_handed_back_request_continues_or_starts_over_as_stated(settings, r):
    """One drain hands back a chat, a text prompt, an n = 2 request and one with a frequency
    penalty (a grammar: tests/test_agents_structured.py); the next worker continues the first two
    after their saved tokens (one record each, every token once, logprobs and per-token weight
    versions aligned, segments naming both workers) and starts the others over."""
    s = settings.with_(drain_timeout_s=0.0, claim_idle_ms=400)
    a = Worker(s, SyntheticEngine(token_ms=5, weight_version="1"), max_inflight=8, block_ms=100, name="a")
    b = Worker(s, SyntheticEngine(token_ms=2, weight_version="2"), max_inflight=8, block_ms=100, name="b")
    sp = {"max_new_tokens": TOKENS, "ignore_eos": True}
    requests = {
        "chat": make_request(request_id="chat", messages=[{"role": "user", "content": "hello"}], return_logprob=True,
                             sampling_params={**sp, "sampling_seed": 3}),
        "text": make_request(request_id="text", prompt="once upon", return_logprob=True, sampling_params=sp),
        "n2": make_request(request_id="n2", input_ids=[1, 2, 3], sampling_params={**sp, "n": 2}),
        "penalty": make_request(request_id="penalty", input_ids=[1, 2, 3],
                                sampling_params={**sp, "frequency_penalty": 0.5}),
    }
    async with Producer(s) as p:
        futures = {k: await p.submit(req) for k, req in requests.items()}
        task = asyncio.create_task(a.run())
        await wait_until(lambda: a.stats.checkpoints == 0 and a.generating_count == 4, 10)
        await asyncio.sleep(0.4)  # (about 80 tokens each: a hands back far from the end)
        a.request_stop()
        await asyncio.wait_for(task, 10)
        saved = {k: await load_checkpoint(r, s.keys, k) for k in requests}
        assert saved["chat"] and saved["text"] and saved["n2"] is None and saved["penalty"] is None
        assert all(0 < saved[k].tokens < TOKENS for k in ("chat", "text"))
        async with running(b):
            records = {k: await asyncio.wait_for(f, 20) for k, f in futures.items()}
    for kind in ("chat", "text"):
        record, cp = records[kind], saved[kind]
        ids, lps = record.output_token_ids[0], record.output_logprobs[0]
        assert record.status is RecordStatus.FINISHED and len(ids) == len(lps) == TOKENS
        assert ids[:cp.tokens] == cp.token_ids and lps[:cp.tokens] == cp.logprobs
        assert record.weight_versions[0] == ["1"] * cp.tokens + ["2"] * (TOKENS - cp.tokens)
        assert [x["worker"] for x in record.meta_info["segments"]] == ["a", "b"]
        assert record.meta_info["resumed_from"] == cp.tokens
        assert record.output_text[0] == WORDS.decode(ids)  # (the whole text, decoded from every token)
    assert records["chat"].meta_info["prompt_tokens"] == len(WORDS.apply_chat_template(
        [{"role": "user", "content": "hello"}]))
    for kind in ("n2", "penalty"):
        record = records[kind]
        assert record.status is RecordStatus.FINISHED and "segments" not in record.meta_info
        assert all(len(ids) == TOKENS for ids in record.output_token_ids) and record.meta_info["attempt"] == 2
    # b decoded what was left of the two that continued, and the others whole.
    left = sum(TOKENS - saved[k].tokens for k in ("chat", "text"))
    assert b.engine.tokens_decoded == left + 2 * TOKENS + TOKENS
    assert [await r.exists(s.keys.partial(k)) for k in requests] == [0] * 4  # (the finishes deleted them)
