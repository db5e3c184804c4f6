"""A worker given notice (SIGTERM) while holding long requests, at default settings, as a real
process (engine_worker/notice.py): what will finish inside the notice finishes there; the rest is
saved and handed over at once, and an idle worker takes it within a second and continues it."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import redis

from redroll.engine_worker.engines.synthetic import SyntheticEngine, SyntheticWords
from redroll.engine_worker.worker import Worker
from redroll.producer import Producer
from redroll.producer.client import make_request
from redroll.shared.checkpoint_reads import load_checkpoint
from redroll.shared.keys import WORKERS_GROUP
from redroll.shared.settings import Settings
from redroll.shared.streams import text
from redroll.shared.types import RecordStatus
from tests.conftest import running, spawn, stop_process, wait_until

LONG, SHORT = 4000, 600
"""Tokens: at the doomed worker's 10 ms a token a long request needs 40 s (more than the default
25 s notice), a short one 6 s (still running at the notice, done well inside it)."""


@pytest.mark.slow
async def test_a_worker_given_notice_hands_over_at_once_and_the_survivor_continues(settings, r, tmp_path):
    defaults = Settings(redis_url=settings.redis_url, namespace=settings.namespace)  # (notice 25 s, claim_idle 30 s)
    keys = defaults.keys
    doomed = spawn(defaults, "worker", "--engine", "synthetic", "--token-ms", "10", "--weight-version", "1",
                   "--name", "doomed", log=tmp_path / "doomed.log")
    sp = {"max_new_tokens": LONG, "ignore_eos": True}
    long = {
        "ids": make_request(request_id="ids", input_ids=[5, 6, 7], return_logprob=True, sampling_params=sp),
        "chat": make_request(request_id="chat", messages=[{"role": "user", "content": "tell me"}],
                             return_logprob=True, sampling_params={**sp, "sampling_seed": 11}),
        "n2": make_request(request_id="n2", input_ids=[5, 6, 7], sampling_params={**sp, "n": 2}),
        "penalty": make_request(request_id="penalty", prompt="{", sampling_params={**sp, "frequency_penalty": 0.5}),
    }
    short = {f"short-{i}": make_request(request_id=f"short-{i}", input_ids=[9, i], return_logprob=True,
                                        sampling_params={"max_new_tokens": SHORT, "ignore_eos": True})
             for i in range(2)}
    survivor = Worker(defaults, SyntheticEngine(token_ms=1, weight_version="2"), max_inflight=16, block_ms=200,
                      name="survivor")
    try:
        async with Producer(defaults) as p:
            futures = {rid: await p.submit(req) for rid, req in {**long, **short}.items()}
            streamed: list = []

            async def read_stream() -> None:
                async for chunk in p.stream(request_id="streamed", prompt="go", sampling_params=sp, timeout=120):
                    streamed.append(chunk)

            reader = asyncio.create_task(read_stream())

            async def holding(consumer: str, n: int) -> bool:
                try:
                    pending = await r.xpending_range(keys.requests, WORKERS_GROUP, "-", "+", 100)
                except redis.ResponseError:  # (no worker made the group yet)
                    return False
                return sum(text(x["consumer"]) == consumer for x in pending) == n

            await wait_until(lambda: holding("doomed", 7), 30)  # (every request on the doomed worker)
            await wait_until(lambda: len(streamed) >= 2, 30)  # (it generates: its reader has chunks)
            async with running(survivor):
                await wait_until(lambda: survivor.started.is_set(), 10)
                noticed = time.monotonic()
                doomed.send_signal(signal.SIGTERM)
                running_at_notice = [not futures[rid].done() for rid in short]
                # Within a second the idle survivor holds every long request, its partial output saved.
                await wait_until(lambda: holding("survivor", 5), 1.0, interval=0.01)
                handed_in = time.monotonic() - noticed
                saved = {rid: await load_checkpoint(r, keys, rid)
                         for rid in ("ids", "chat", "streamed")}
                records = {rid: await asyncio.wait_for(f, 60) for rid, f in futures.items()}
                await asyncio.wait_for(reader, 60)
            assert doomed.wait(30) == 0  # (it exits once what it let finish has finished)
    finally:
        if doomed.poll() is None:
            stop_process(doomed)
    assert handed_in <= 1.0 and all(running_at_notice), (handed_in, running_at_notice)
    print(f"handed over in {handed_in:.3f} s")
    # What finishes inside the notice finished on the first worker, once.
    for rid in short:
        assert records[rid].meta_info["worker"] == "doomed" and records[rid].meta_info["attempt"] == 1
        assert "segments" not in records[rid].meta_info and len(records[rid].output_token_ids[0]) == SHORT
    # The long single-sample ones continue after their saved tokens, whatever their prompt.
    streamed_record = streamed[-1].record
    records["streamed"] = streamed_record
    for rid in ("ids", "chat", "streamed"):
        record, cp = records[rid], saved[rid]
        ids = record.output_token_ids[0]
        assert record.status is RecordStatus.FINISHED and len(ids) == LONG
        assert cp is not None and 0 < cp.tokens < LONG and ids[:cp.tokens] == cp.token_ids
        assert record.meta_info["resumed_from"] == cp.tokens
        assert record.meta_info["attempt"] == 2  # (the second run; a notice raised no delivery count)
        assert [(x["worker"], x["weight_version"]) for x in record.meta_info["segments"]] == [
            ("doomed", "1"), ("survivor", "2")]
        assert record.weight_versions[0] == ["1"] * cp.tokens + ["2"] * (LONG - cp.tokens)
        if record.output_logprobs:
            assert len(record.output_logprobs[0]) == LONG and record.output_logprobs[0][:cp.tokens] == cp.logprobs
    assert records["chat"].output_text[0] == SyntheticWords().decode(records["chat"].output_token_ids[0])
    # The streamed request's reader saw every token once, in order, across the two workers.
    assert [t for c in streamed for t in c.token_ids] == streamed_record.output_token_ids[0]
    assert [c.offset for c in streamed] == [sum(len(c.token_ids) for c in streamed[:i]) for i in range(len(streamed))]
    # n > 1 and a frequency penalty start over on the survivor (a grammar: tests/test_agents_structured.py) (nothing saved of them).
    for rid in ("n2", "penalty"):
        assert records[rid].status is RecordStatus.FINISHED and "segments" not in records[rid].meta_info
        assert records[rid].meta_info["worker"] == "survivor"
        assert all(len(ids) == LONG for ids in records[rid].output_token_ids)
    # The survivor decoded what was left of the ones that continued, and the others whole.
    left = sum(LONG - saved[rid].tokens for rid in ("ids", "chat", "streamed"))
    assert survivor.engine.tokens_decoded == left + 2 * LONG + LONG


async def test_a_worker_joining_mid_run_loads_the_desired_weights_and_takes_work_within_a_second(settings, r):
    """Scale-up: a worker that joins takes what waits at once — queued requests, and the ones a
    worker given notice handed back with no other worker alive — on the fleet's desired weights."""
    from redroll.ops.control import update_weights

    s = settings.with_(claim_idle_ms=30_000, notice_s=0.0)  # (the default claim_idle: no reclaim poll helps)
    first = Worker(s, SyntheticEngine(token_ms=10), max_inflight=8, block_ms=200, name="first")
    sp = {"max_new_tokens": 3000, "ignore_eos": True}
    async with Producer(s) as p:
        handed = [await p.submit(input_ids=[1, i], sampling_params=sp) for i in range(2)]
        async with running(first):
            await wait_until(lambda: first.generating_count == 2, 10)
        assert first.stats.handed_back == 2  # (given notice with nobody to take them: they wait, saved)
        await update_weights(r, s.keys, "/models/step-7", "7", wait=False)
        queued = [await p.submit(input_ids=[2, i], sampling_params={"max_new_tokens": 20}) for i in range(2)]
        joiner = Worker(s, SyntheticEngine(token_ms=1), max_inflight=8, block_ms=200, name="joiner")
        versions_at_start: list = []
        async with running(joiner):
            await wait_until(lambda: joiner.started.is_set(), 20)
            joined = time.monotonic()
            versions_at_start.append(joiner.engine.info.weight_version)
            await wait_until(lambda: joiner.stats.claimed + joiner.stats.reclaimed >= 4, 1.0, interval=0.01)
            took = time.monotonic() - joined
            records = [await asyncio.wait_for(f, 30) for f in handed + queued]
    assert took <= 1.0 and versions_at_start == ["7"]
    assert all(rec.status is RecordStatus.FINISHED and rec.meta_info["weight_version"] == "7" for rec in records)
    assert [x["worker"] for x in records[0].meta_info["segments"]] == ["first", "joiner"]
