"""The transformers engine's prefix cache: hits are exact, counted honestly, evicted and flushed."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from redroll.engine_worker.engines.base import EngineOutput  # noqa: E402
from redroll.engine_worker.engines.prefix_cache import PrefixCache  # noqa: E402
from redroll.engine_worker.engines.tiny_model import build_tiny_model, teacher_forced_logprobs  # noqa: E402
from redroll.engine_worker.engines.transformers_engine import TransformersEngine  # noqa: E402
from redroll.shared.types import GenerationRequest, SamplingParams  # noqa: E402
from tests.conftest import started  # noqa: E402

TOLERANCE = 1e-4
PROMPT = [(7 * i + 3) % 250 for i in range(40)]


@pytest.fixture(scope="module")
def reference_model() -> Any:
    return build_tiny_model(seed=0)


@pytest.fixture
async def cached() -> AsyncIterator[TransformersEngine]:
    async with started(TransformersEngine(prefix_cache_tokens=4096)) as eng:
        yield eng


@pytest.fixture
async def plain() -> AsyncIterator[TransformersEngine]:
    async with started(TransformersEngine()) as eng:
        yield eng


def request(rid: str, input_ids: list[int], **sampling: Any) -> GenerationRequest:
    sampling.setdefault("ignore_eos", True)
    return GenerationRequest(request_id=rid, input_ids=list(input_ids), return_logprob=True,
                             sampling_params=SamplingParams(**sampling))


async def generate_all(engine: TransformersEngine, *requests: GenerationRequest) -> list[EngineOutput]:
    """Submitted in the same tick: one batch."""
    return list(await asyncio.gather(*(engine.generate(r, r.request_id) for r in requests)))


def assert_teacher_forced(model: Any, req: GenerationRequest, out: EngineOutput) -> None:
    for sample in out.samples:
        want = teacher_forced_logprobs(model, req.input_ids, sample.token_ids, req.sampling_params.temperature)
        assert len(sample.logprobs) == len(want) == len(sample.token_ids)
        assert max((abs(a - b) for a, b in zip(sample.logprobs, want)), default=0.0) < TOLERANCE, req.request_id


def assert_same_samples(a: EngineOutput, b: EngineOutput) -> None:
    assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
    for x, y in zip(a.samples, b.samples):
        assert x.logprobs == pytest.approx(y.logprobs, abs=TOLERANCE)


def counters(engine: TransformersEngine) -> tuple[int, int]:
    return engine.prefill_tokens_computed, engine.prefill_tokens_cached


# ---------------------------------------------------------------- the LRU itself


def kv_of(tokens: list[int]) -> list[tuple[Any, Any]]:
    """Two fake layers whose KV at each position is that position's token (to check slicing)."""
    t = torch.tensor(tokens, dtype=torch.float32).view(1, 1, -1, 1)
    return [(t, -t), (t * 2, -t * 2)]


def test_prefix_cache_lookup_insert_evict_clear() -> None:
    cache = PrefixCache(10)
    assert cache.lookup([1, 2, 3], "v") == (0, None)
    assert cache.insert([1, 2, 3, 4], kv_of([1, 2, 3, 4]), "v")
    length, kv = cache.lookup([1, 2, 3, 9, 9], "v")
    assert length == 3 and kv[1][0].flatten().tolist() == [2, 4, 6] and kv[0][1].flatten().tolist() == [-1, -2, -3]
    assert cache.lookup([1, 2, 3, 4, 5], "v", limit=2)[0] == 2
    assert cache.lookup([1, 2, 3, 4], "other")[0] == 0  # tagged with the weight version

    assert not cache.insert([1, 2], kv_of([1, 2]), "v")  # covered by [1, 2, 3, 4]
    assert cache.insert([1, 2, 3, 4, 5, 6], kv_of([1, 2, 3, 4, 5, 6]), "v")  # replaces its prefix
    assert cache.sequences() == [(1, 2, 3, 4, 5, 6)] and cache.tokens == 6
    assert cache.insert([7, 8, 9], kv_of([7, 8, 9]), "v")
    assert cache.lookup([1, 2, 5], "v")[0] == 2  # refreshes [1..6]: [7, 8, 9] is now the least recent
    assert cache.insert([5, 5, 5], kv_of([5, 5, 5]), "v")  # 12 > 10: evict [7, 8, 9]
    assert cache.sequences() == [(1, 2, 3, 4, 5, 6), (5, 5, 5)] and cache.tokens == 9
    assert not cache.insert(list(range(11)), kv_of(list(range(11))), "v")  # larger than the capacity
    assert cache.tokens == 9
    assert cache.insert([1, 2, 3], kv_of([1, 2, 3]), "w")  # a new version drops the old one's entries
    assert cache.sequences() == [(1, 2, 3)]
    cache.clear()
    assert (len(cache), cache.tokens) == (0, 0)


# ---------------------------------------------------------------- the engine


async def test_off_by_default_counts_every_row(plain: TransformersEngine) -> None:
    assert plain.prefix_cache is None
    outs = await generate_all(plain, request("a", PROMPT, n=3, max_new_tokens=4, temperature=0.0),
                              request("b", PROMPT[:10], max_new_tokens=4, temperature=0.0))
    assert [o.cached_tokens for o in outs] == [0, 0]
    assert counters(plain) == (3 * 40 + 10, 0)


async def test_same_prompt_in_one_batch_is_prefilled_once(cached, plain, reference_model) -> None:
    reqs = [request(f"r{i}", PROMPT, max_new_tokens=10, temperature=1.0, sampling_seed=i) for i in range(8)]
    outs = await generate_all(cached, *reqs)
    assert counters(cached) == (40, 7 * 40)
    assert [o.cached_tokens for o in outs] == [0] + [40] * 7
    expected = await generate_all(plain, *reqs)
    for req, out, want in zip(reqs, outs, expected):
        assert_same_samples(out, want)
        assert_teacher_forced(reference_model, req, out)

    # The same prompt again: served from the cache but its last token.
    again = (await generate_all(cached, request("again", PROMPT, max_new_tokens=5, temperature=0.0)))[0]
    assert again.cached_tokens == 39 and counters(cached) == (41, 7 * 40 + 39)


async def test_n_samples_share_one_prefill(cached, plain, reference_model) -> None:
    req = request("n4", PROMPT, n=4, max_new_tokens=12, temperature=0.9, sampling_seed=5)
    out = (await generate_all(cached, req))[0]
    assert out.cached_tokens == 0 and counters(cached) == (40, 0)
    assert_same_samples(out, (await generate_all(plain, req))[0])
    assert_teacher_forced(reference_model, req, out)


async def test_next_turn_hits_the_whole_conversation(cached, plain, reference_model) -> None:
    first = request("turn1", PROMPT, max_new_tokens=16, temperature=0.0)
    out1 = (await generate_all(cached, first))[0]
    history = PROMPT + out1.samples[0].token_ids
    second = request("turn2", history + [101, 102, 103, 104, 105], max_new_tokens=16, temperature=0.7,
                     sampling_seed=3)
    before = cached.prefill_tokens_computed
    out2 = (await generate_all(cached, second))[0]
    assert out2.cached_tokens == len(history) - 1  # all but the last output token, whose KV never existed
    assert cached.prefill_tokens_computed - before == 5 + 1
    assert_same_samples(out2, (await generate_all(plain, second))[0])
    assert_teacher_forced(reference_model, second, out2)


async def test_rows_of_different_lengths_store_exactly_their_tokens(cached, plain, reference_model) -> None:
    """Left padding, rows that finish early (then fed pad) and partial hits, in one batch and the next."""
    warm = request("warm", PROMPT[:25], max_new_tokens=1, temperature=0.0)
    await generate_all(cached, warm)
    turn1 = [
        request("short", PROMPT[:25] + [9, 9], max_new_tokens=3, temperature=0.0),  # partial hit, ends first
        request("long", [5, 6, 7], max_new_tokens=20, temperature=1.0, sampling_seed=1),
        request("mid", PROMPT, max_new_tokens=9, temperature=1.0, sampling_seed=2),
        request("stops", [40, 41, 42, 43], max_new_tokens=20, temperature=1.2, sampling_seed=4, ignore_eos=False,
                stop_token_ids=tuple(range(0, 256, 3))),  # finishes early on a stop token
    ]
    outs1 = await generate_all(cached, *turn1)
    assert outs1[0].cached_tokens == 25 and outs1[2].cached_tokens == 25
    for req, out in zip(turn1, outs1):
        assert_same_samples(out, (await generate_all(plain, req))[0])
        assert_teacher_forced(reference_model, req, out)

    turn2 = [request(f"next-{req.request_id}", req.input_ids + out.samples[0].token_ids + [77, 78],
                     max_new_tokens=6, temperature=1.0, sampling_seed=9)
             for req, out in zip(turn1, outs1)]
    outs2 = await generate_all(cached, *turn2)
    for prev_req, prev_out, req, out in zip(turn1, outs1, turn2, outs2):
        history = len(prev_req.input_ids) + len(prev_out.samples[0].token_ids)
        assert out.cached_tokens == (history - 1 if len(prev_out.samples[0].token_ids) > 1 else len(prev_req.input_ids))
        assert_same_samples(out, (await generate_all(plain, req))[0])
        assert_teacher_forced(reference_model, req, out)


async def test_prompt_logprobs_bypass_the_lookup_but_fill_the_cache(cached, reference_model) -> None:
    await generate_all(cached, request("warm", PROMPT, max_new_tokens=1))
    prompt = PROMPT + [1, 2, 3]
    req = GenerationRequest(request_id="plp", input_ids=prompt, return_logprob=True, logprob_start_len=0,
                            sampling_params=SamplingParams(max_new_tokens=3, temperature=0.0))
    before = cached.prefill_tokens_computed
    out = (await generate_all(cached, req))[0]
    assert out.cached_tokens == 0 and cached.prefill_tokens_computed - before == len(prompt)
    want = teacher_forced_logprobs(reference_model, prompt[:1], prompt[1:], 1.0)
    assert out.input_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(out.input_logprobs[1:], want)) < TOLERANCE
    assert_teacher_forced(reference_model, req, out)
    follow = (await generate_all(cached, request("follow", prompt, max_new_tokens=2)))[0]
    assert follow.cached_tokens == len(prompt) - 1


async def test_small_capacity_evicts_least_recently_used(reference_model) -> None:
    eng = TransformersEngine(prefix_cache_tokens=64)
    await eng.start()
    try:
        a, b, c = ([base + i for i in range(30)] for base in (0, 50, 100))
        for rid, prompt in (("a", a), ("b", b)):
            await generate_all(eng, request(rid, prompt, max_new_tokens=1))
        assert eng.prefix_cache.sequences() == [tuple(a), tuple(b)]
        assert (await generate_all(eng, request("a2", a, max_new_tokens=1)))[0].cached_tokens == 29  # a: most recent
        await generate_all(eng, request("c", c, max_new_tokens=1))  # 90 > 64: b goes
        assert eng.prefix_cache.sequences() == [tuple(a), tuple(c)] and eng.prefix_cache.tokens == 60
        assert (await generate_all(eng, request("b2", b, max_new_tokens=1)))[0].cached_tokens == 0
        big = list(range(65))
        out = (await generate_all(eng, request("big", big, max_new_tokens=1)))[0]
        assert out.cached_tokens == 0 and tuple(big) not in eng.prefix_cache.sequences()  # larger than capacity
        assert eng.prefix_cache.tokens <= 64
        assert_teacher_forced(reference_model, request("big", big, max_new_tokens=1), out)
    finally:
        await eng.close()


def perturbed(seed: int) -> Any:
    model = build_tiny_model(0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


async def test_every_weight_change_flushes_the_cache(cached) -> None:
    await generate_all(cached, request("warm", PROMPT, max_new_tokens=1))
    assert len(cached.prefix_cache) == 1
    updates = [
        ("tensor", lambda: cached.update_weights_from_tensor(perturbed(1).named_parameters(), "1"), perturbed(1)),
        ("disk-in-place", lambda: cached.update_weights_from_disk("tiny-random:2", "2", in_place=True),
         build_tiny_model(2)),
        ("disk", lambda: cached.update_weights_from_disk("tiny-random:3", "3"), build_tiny_model(3)),
    ]
    for tag, update, model in updates:
        await update()
        assert len(cached.prefix_cache) == 0 and cached.prefix_cache.tokens == 0, tag
        req = request(f"{tag}-after", PROMPT, max_new_tokens=8, temperature=1.0, sampling_seed=7)
        out = (await generate_all(cached, req))[0]
        assert out.cached_tokens == 0 and out.weight_version == cached.info.weight_version, tag
        assert_teacher_forced(model, req, out)  # the new weights' KV, not the old
        assert (await generate_all(cached, request(f"{tag}-hit", PROMPT, max_new_tokens=1)))[0].cached_tokens == 39


async def test_a_swap_during_a_batch_stores_none_of_its_kv(cached) -> None:
    long = asyncio.ensure_future(cached.generate(request("long", PROMPT, max_new_tokens=400), "long"))
    while (cached.progress("long") or 0) < 3:
        await asyncio.sleep(0.002)
    await cached.update_weights_from_tensor(perturbed(1).named_parameters(), "1")
    out = await asyncio.wait_for(long, 60)
    assert out.samples[0].weight_versions is not None  # it spanned the swap
    assert len(cached.prefix_cache) == 0  # the prompt's entry was flushed, the mixed conversation never stored
    assert (await generate_all(cached, request("after", PROMPT, max_new_tokens=1)))[0].cached_tokens == 0
