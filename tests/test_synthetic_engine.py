"""The synthetic engine: deterministic tokens from (input, seed, sample), aborts, stop tokens."""

from __future__ import annotations

import asyncio
import hashlib
from array import array

import pytest

from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.producer.client import make_request


def _expected_words(source: bytes, seed: object, sample: int, n: int) -> list[int]:
    """The documented derivation: SHAKE-256 of ``source|seed:<seed>|<sample>``, 32 bits per word."""
    digest = hashlib.shake_256(source + f"|seed:{seed}|{sample}".encode()).digest(8 * n)
    return list(array("I", digest))


def test_tokens_follow_the_hash_of_input_seed_and_sample():
    engine = SyntheticEngine(vocab_size=1000)
    req = make_request(request_id="r-1", input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 6})
    words = _expected_words(b"ids:" + array("q", [5, 6, 7]).tobytes(), "r-1", 2, 6)
    ids, logprobs = engine.tokens_for(req, 2)
    assert ids == [w % 1000 for w in words[:6]]
    assert logprobs == [w * (-4.0 / 4294967296.0) for w in words[6:]]
    # Without logprobs the ids are the same; another sample gives other ids.
    assert engine.tokens_for(req, 2, with_logprobs=False) == (ids, [])
    assert engine.tokens_for(req, 3)[0] != ids


def test_a_seed_replaces_the_request_id_and_prompts_hash_their_text():
    engine = SyntheticEngine(vocab_size=1000)
    a = make_request(request_id="a", prompt="héllo", sampling_params={"max_new_tokens": 4, "sampling_seed": 9})
    b = make_request(request_id="b", prompt="héllo", sampling_params={"max_new_tokens": 4, "sampling_seed": 9})
    assert engine.tokens_for(a, 0) == engine.tokens_for(b, 0)
    words = _expected_words("prompt:héllo".encode(), 9, 0, 4)
    assert engine.tokens_for(a, 0)[0] == [w % 1000 for w in words[:4]]


async def test_zero_delay_generation_runs_to_its_length():
    engine = SyntheticEngine()
    req = make_request(request_id="z", input_ids=[1], sampling_params={"max_new_tokens": 5, "n": 2},
                       return_logprob=True)
    out = await engine.generate(req, "h-z")
    assert [s.finish_reason for s in out.samples] == ["length", "length"]
    assert [len(s.token_ids) for s in out.samples] == [5, 5] and not out.aborted
    assert all(len(s.logprobs) == 5 for s in out.samples)
    engine.abort("h-z")  # after the end (or for an unknown handle): nothing happens


async def test_abort_mid_generation_returns_the_tokens_so_far():
    engine = SyntheticEngine(token_ms=20)
    req = make_request(request_id="slow", input_ids=[1], sampling_params={"max_new_tokens": 50})
    task = asyncio.create_task(engine.generate(req, "h-slow"))
    await asyncio.sleep(0.1)
    engine.abort("h-slow")
    out = await asyncio.wait_for(task, 2)
    assert out.aborted and out.samples[0].finish_reason == "abort"
    assert 0 < len(out.samples[0].token_ids) < 50
    assert out.samples[0].token_ids == engine.tokens_for(req, 0)[0][: len(out.samples[0].token_ids)]


async def test_a_stop_token_ends_the_sample():
    engine = SyntheticEngine()
    req = make_request(request_id="s", input_ids=[1], sampling_params={"max_new_tokens": 8})
    full, _ = engine.tokens_for(req, 0)
    stop = full[3]
    req = make_request(request_id="s", input_ids=[1], sampling_params={"max_new_tokens": 8, "stop_token_ids": [stop]})
    sample = (await engine.generate(req, "h-s")).samples[0]
    assert sample.finish_reason == "stop"
    assert sample.token_ids == full[: full.index(stop) + 1]


async def test_with_per_token_time_a_stop_token_ends_the_generation_and_its_partial_output():
    # (a resumable request is checkpointed from partial(): past its stop it once reported the
    # tokens after the stop too, and a resumed request ran past its stop token)
    engine = SyntheticEngine(token_ms=10)
    req = make_request(request_id="s", input_ids=[1], sampling_params={"max_new_tokens": 200})
    full, _ = engine.tokens_for(req, 0)
    stop = next(t for j, t in enumerate(full) if j >= 5 and t not in full[:j])
    cut = full.index(stop) + 1
    req = make_request(request_id="s", input_ids=[1], sampling_params={"max_new_tokens": 200, "stop_token_ids": [stop]})
    started = asyncio.get_running_loop().time()
    task = asyncio.create_task(engine.generate(req, "h-s"))
    await asyncio.sleep(cut * 0.010 / 2)
    early = engine.partial("h-s")
    assert early is not None and early.finish_reason is None and early.token_ids == full[: len(early.token_ids)]
    assert len(early.token_ids) < cut
    sample = (await asyncio.wait_for(task, 5)).samples[0]
    took = asyncio.get_running_loop().time() - started
    assert sample.finish_reason == "stop" and sample.token_ids == full[:cut]
    assert took < 200 * 0.010 / 2  # (done at its stop token, not after max_new_tokens)
    engine._running["h-late"] = (req, started - 1.0, 10.0)  # (as if it had run 1 s: 100 tokens' time)
    late = engine.partial("h-late")
    assert late is not None and late.token_ids == full[:cut] and late.finish_reason == "stop"


@pytest.mark.parametrize("extra, field", [
    ({"top_logprobs_num": 2, "return_logprob": True}, "top_logprobs_num"),
    ({"logprob_start_len": 0, "return_logprob": True}, "logprob_start_len"),
    ({"return_routed_experts": True}, "return_routed_experts"),
])
def test_extras_it_cannot_produce_are_refused_naming_the_field(extra, field):
    from redroll.engine_worker.engines.synthetic import SyntheticEngine
    from redroll.shared.codec import ValidationError
    from redroll.shared.types import GenerationRequest

    with pytest.raises(ValidationError) as ei:
        SyntheticEngine().validate(GenerationRequest(request_id="x", input_ids=[1], **extra))
    assert ei.value.field == field and "synthetic" in ei.value.reason


def test_with_a_context_a_text_prompt_is_checked_as_token_ids_are():
    from redroll.shared.codec import ValidationError

    engine = SyntheticEngine(max_context=64)  # (a text prompt is one token per byte)
    for req in (make_request(request_id="t", prompt="x" * 60, sampling_params={"max_new_tokens": 10}),
                make_request(request_id="i", input_ids=[1] * 60, sampling_params={"max_new_tokens": 10})):
        with pytest.raises(ValidationError) as ei:
            engine.validate(req)
        assert ei.value.field == "sampling_params.max_new_tokens"
        assert "prompt (60 tokens) + max_new_tokens (10) exceeds the model context of 64" in ei.value.rule
    engine.validate(make_request(request_id="fits", prompt="x" * 60, sampling_params={"max_new_tokens": 4}))


async def test_without_per_token_time_or_slots_it_is_instant_and_generate_now_gives_generates_output():
    engine = SyntheticEngine()
    assert engine.instant
    assert not SyntheticEngine(token_ms=1).instant and not SyntheticEngine(slots=4).instant
    req = make_request(request_id="now", input_ids=[1, 2], return_logprob=True,
                       sampling_params={"max_new_tokens": 6, "n": 3})
    now, later = engine.generate_now(req), await engine.generate(req, "h-now")
    assert [(s.token_ids, s.logprobs, s.finish_reason) for s in now.samples] == \
        [(s.token_ids, s.logprobs, s.finish_reason) for s in later.samples]
    assert now.prompt_tokens == 2 and engine.tokens_decoded == 36


def test_generate_now_raises_the_injected_failure():
    engine = SyntheticEngine(raise_marker="BOOM")
    with pytest.raises(RuntimeError, match="synthetic engine failure for b"):
        engine.generate_now(make_request(request_id="b", prompt="a BOOM", sampling_params={"max_new_tokens": 2}))
