"""A structured request (a JSON schema) continued on another worker: the transformers engine
advances its grammar over the saved tokens (a worker SIGKILLed after the request's first
checkpoint; the survivor's output is schema-valid and starts with the saved tokens); an engine that
cannot take a grammar up mid-output (vLLM's case: no ``grammar_resume``) starts it over from the
prompt, its checkpoint deleted, and refuses to go on with a streamed one (its reader has the tokens)."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

pytest.importorskip("torch")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from redroll.engine_worker.engines.transformers_engine import TransformersEngine  # noqa: E402
from redroll.engine_worker.worker import Worker  # noqa: E402
from redroll.producer import Producer  # noqa: E402
from redroll.producer.client import make_request  # noqa: E402
from redroll.shared.checkpoint_reads import load_checkpoint  # noqa: E402
from redroll.shared.types import RecordStatus  # noqa: E402
from tests.agents_engines import NoGrammarResume, StepDelayed  # noqa: E402
from tests.agents_support import CARD_SCHEMA, valid_card  # noqa: E402
from tests.conftest import running, spawn, stop_process, wait_until  # noqa: E402

PROMPT = [10, 20, 30, 40]
EVERY = {"checkpoint_tokens": 4, "checkpoint_interval_s": 0.0, "checkpoint_min_new_tokens": 16}
"""A checkpoint every 4 tokens, from the first ones on."""


def structured(rid: str, seed: int, **kw):
    return make_request(request_id=rid, input_ids=PROMPT, resumable=not kw.get("stream"), return_logprob=True,
                        sampling_params={"max_new_tokens": 160, "temperature": 1.0, "sampling_seed": seed,
                                         "json_schema": json.dumps(CARD_SCHEMA)}, **kw)


async def checkpoint_of(r, settings, rid: str):
    return await load_checkpoint(r, settings.keys, rid)


@pytest.mark.timeout(180)
async def test_a_worker_killed_after_the_first_checkpoint_the_survivor_advances_the_grammar(settings, r, tmp_path):
    s = settings.with_(**EVERY)
    env = {f"REDROLL_{k.upper()}": str(v) for k, v in EVERY.items()}
    proc = spawn(s, "worker", "--engine", "tests.agents_engines:StepDelayed", "--engine-arg", "step_ms=150",
                 "--max-inflight", "2", "--name", "killed", log=tmp_path / "killed.log", **env)
    try:
        async with Producer(s) as p:
            future = await p.submit(structured("kill-1", seed=5))

            async def first_checkpoint():
                cp = await checkpoint_of(r, s, "kill-1")
                return cp if cp is not None and cp.tokens else None
            await wait_until(first_checkpoint, 120, check=lambda: proc.poll() is None or pytest.fail("worker died"))
            os.kill(proc.pid, signal.SIGKILL)  # (mid-generation: 150 ms a token, a checkpoint every 4)
            proc.wait()
            cp = await checkpoint_of(r, s, "kill-1")
            assert cp.finish_reason is None and cp.tokens >= 4
            survivor = Worker(s, TransformersEngine(), max_inflight=2, block_ms=100, name="survivor")
            async with running(survivor):
                record = await asyncio.wait_for(future, 60)
    finally:
        if proc.poll() is None:
            stop_process(proc)
    ids = record.output_token_ids[0]
    assert record.status is RecordStatus.FINISHED and record.finish_reasons == ["stop"]
    assert valid_card(survivor.engine.tokenizer.decode(ids)), ids
    assert ids[:cp.tokens] == cp.token_ids and record.meta_info["resumed_from"] == cp.tokens
    assert [x["worker"] for x in record.meta_info["segments"]] == ["killed", "survivor"]
    assert survivor.engine.tokens_decoded == len(ids) - cp.tokens  # (the grammar was advanced, not re-run)


async def test_an_engine_that_cannot_take_a_grammar_up_starts_the_request_over(settings, r):
    s = settings.with_(drain_timeout_s=0.2, **EVERY)
    a = Worker(s, StepDelayed(step_ms=40), max_inflight=4, block_ms=100, name="a")
    b = Worker(s, NoGrammarResume(), max_inflight=4, block_ms=100, name="b")
    async with Producer(s) as p:
        task = asyncio.create_task(a.run())
        plain = await p.submit(structured("over-1", seed=3))
        streamed = await p.submit(structured("over-s", seed=4, stream=True))

        async def both_saved():
            return all([await checkpoint_of(r, s, rid) for rid in ("over-1", "over-s")])
        await wait_until(both_saved, 60)
        a.request_stop()  # (a drain: each keeps what it made, and goes back)
        await asyncio.wait_for(task, 30)
        assert (await checkpoint_of(r, s, "over-1")).tokens >= 4
        async with running(b):
            record, refused = await asyncio.wait_for(asyncio.gather(plain, streamed), 60)
    # started over on b: from the prompt, under the whole grammar, nothing stitched
    ids = record.output_token_ids[0]
    assert record.status is RecordStatus.FINISHED and record.finish_reasons == ["stop"]
    assert valid_card(b.engine.tokenizer.decode(ids)) and "segments" not in record.meta_info and b.stats.resumed == 0
    assert record.meta_info["worker"] == "b" and record.meta_info["prompt_tokens"] == len(PROMPT)
    assert b.engine.tokens_decoded == len(ids)
    assert not await r.exists(s.keys.partial("over-1"))
    # a streamed one cannot start over (its reader has the saved tokens): refused naming stream
    assert refused.status is not RecordStatus.FINISHED and "stream" in (refused.error or ""), refused
