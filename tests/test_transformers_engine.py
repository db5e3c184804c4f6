"""TransformersEngine on the tiny random model: logprobs, sampling knobs, seeds, stops, aborts."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from redroll.engine_worker.engines.base import Engine, EngineOutput  # noqa: E402
from redroll.engine_worker.engines.tiny_model import (  # noqa: E402
    EOS_ID,
    ByteTokenizer,
    build_tiny_model,
    teacher_forced_logprobs,
)
from redroll.engine_worker.engines.transformers_engine import TransformersEngine  # noqa: E402
from redroll.shared.codec import ValidationError  # noqa: E402
from redroll.shared.types import GenerationRequest, SamplingParams  # noqa: E402
from tests.conftest import started  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference_model() -> Any:
    """The engine's model, built separately (same seed) for teacher-forced recomputation."""
    return build_tiny_model(seed=0)


@pytest.fixture
async def engine() -> AsyncIterator[TransformersEngine]:
    async with started(TransformersEngine()) as eng:
        yield eng


def request(
    rid: str, input_ids: list[int] | None = None, *, logprobs: bool = True, **sampling: Any
) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid,
        input_ids=input_ids if input_ids is not None else [72, 105, 33],
        return_logprob=logprobs,
        sampling_params=SamplingParams(**sampling),
    )


async def generate_all(engine: TransformersEngine, *requests: GenerationRequest) -> list[EngineOutput]:
    """Submit all requests in the same tick, so that they share one batch."""
    return list(await asyncio.gather(*(engine.generate(r, r.request_id) for r in requests)))


async def wait_for_progress(engine: TransformersEngine, handle: str, tokens: int, timeout: float = 10.0) -> None:
    async def poll() -> None:
        while (engine.progress(handle) or 0) < tokens:
            await asyncio.sleep(0.002)

    await asyncio.wait_for(poll(), timeout)


def weights_digest(model: Any) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.contiguous().numpy().tobytes())
    return h.hexdigest()


def assert_logprobs_match(model: Any, req: GenerationRequest, out: EngineOutput) -> None:
    prompt = req.input_ids
    assert prompt is not None
    for sample in out.samples:
        assert sample.logprobs is not None
        assert len(sample.logprobs) == len(sample.token_ids)
        expected = teacher_forced_logprobs(model, prompt, sample.token_ids, req.sampling_params.temperature)
        diffs = [abs(a - b) for a, b in zip(sample.logprobs, expected)]
        assert max(diffs, default=0.0) < LOGPROB_TOLERANCE, (req.request_id, max(diffs))


# ---------------------------------------------------------------- engine basics


async def test_info_and_protocol(engine: TransformersEngine) -> None:
    assert isinstance(engine, Engine)
    info = engine.info
    assert (info.name, info.model, info.vocab_size) == ("transformers", "tiny-random", 259)
    assert (info.eos_token_id, info.pad_token_id, info.max_context) == (257, 258, 2048)
    assert info.weight_version == "0"
    out = (await generate_all(engine, request("basic", max_new_tokens=4, ignore_eos=True)))[0]
    assert out.prompt_tokens == 3 and out.cached_tokens == 0 and out.weight_version == "0"


def test_import_needs_no_torch() -> None:
    code = "import sys, redroll.engine_worker.engines.transformers_engine; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, timeout=60)


def test_tiny_model_is_deterministic_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(1234)
    expected_draw = torch.rand(3)
    torch.manual_seed(1234)
    model = build_tiny_model(seed=7)
    assert torch.equal(torch.rand(3), expected_draw)

    assert weights_digest(model) == weights_digest(build_tiny_model(seed=7))
    assert weights_digest(model) != weights_digest(build_tiny_model(seed=8))


def test_tiny_model_is_bit_identical_in_another_process() -> None:
    code = (
        "import hashlib; from redroll.engine_worker.engines.tiny_model import build_tiny_model\n"
        "h = hashlib.sha256()\n"
        "for n, t in sorted(build_tiny_model(seed=3).state_dict().items()):\n"
        "    h.update(n.encode()); h.update(t.contiguous().numpy().tobytes())\n"
        "print(h.hexdigest())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, timeout=120,
                          capture_output=True, text=True)
    assert done.stdout.strip() == weights_digest(build_tiny_model(seed=3))


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert ids == list("héllo".encode()) and tok.vocab_size == 259
    assert tok.encode("a", add_bos=True) == [256, 97]
    assert tok.decode([*ids, EOS_ID]) == "héllo"
    assert tok.decode([104, EOS_ID], skip_special_tokens=False) == "h<eos>"
    assert tok.decode([0xFF]) == "\ufffd"


# ---------------------------------------------------------------- logprobs, samples, seeds


async def test_batched_logprobs_match_teacher_forcing(engine: TransformersEngine, reference_model: Any) -> None:
    requests = [
        request("greedy", [5, 17, 200], temperature=0.0, max_new_tokens=24),
        request("warm", list(range(30, 52)), temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=24, sampling_seed=1),
        request("plain", [99] * 9, temperature=1.0, max_new_tokens=24, sampling_seed=2),
        request("hot", [1], temperature=1.3, min_p=0.05, max_new_tokens=24, sampling_seed=3),
    ]
    outputs = await generate_all(engine, *requests)
    for req, out in zip(requests, outputs):
        assert len(out.samples) == 1 and out.samples[0].token_ids
        assert out.samples[0].finish_reason in ("stop", "length")
        assert_logprobs_match(reference_model, req, out)


async def test_n_samples_have_matching_lengths(engine: TransformersEngine, reference_model: Any) -> None:
    req = request("four", temperature=1.0, n=4, max_new_tokens=16, sampling_seed=11)
    out = (await generate_all(engine, req))[0]
    assert len(out.samples) == 4
    assert all(s.logprobs is not None and len(s.logprobs) == len(s.token_ids) for s in out.samples)
    assert len({tuple(s.token_ids) for s in out.samples}) > 1, "samples should differ (seed + index)"
    assert_logprobs_match(reference_model, req, out)


async def test_seeded_request_is_independent_of_its_batch(engine: TransformersEngine) -> None:
    def seeded() -> GenerationRequest:
        return request("seeded", [10, 20, 30], temperature=1.0, top_p=0.95, max_new_tokens=32,
                       sampling_seed=123, ignore_eos=True)

    alone = (await generate_all(engine, seeded()))[0]
    others = [request(f"other{i}", list(range(1, 3 + 9 * i)), temperature=0.9, n=2, max_new_tokens=10 + i)
              for i in range(3)]
    batched = (await generate_all(engine, *others, seeded()))[-1]
    assert batched.samples[0].token_ids == alone.samples[0].token_ids
    assert batched.samples[0].logprobs == pytest.approx(alone.samples[0].logprobs, abs=LOGPROB_TOLERANCE)

    fresh = TransformersEngine()
    await fresh.start()
    try:
        again = (await generate_all(fresh, seeded()))[0]
    finally:
        await fresh.close()
    assert again.samples[0].token_ids == alone.samples[0].token_ids


async def test_wide_requests_and_small_batches(reference_model: Any) -> None:
    eng = TransformersEngine(max_batch_size=2)
    await eng.start()
    try:
        reqs = [request("wide", n=3, temperature=1.0, max_new_tokens=6)] + [
            request(f"narrow{i}", [i + 1, 2], temperature=0.5, max_new_tokens=6) for i in range(3)
        ]
        outs = await generate_all(eng, *reqs)
    finally:
        await eng.close()
    assert [len(o.samples) for o in outs] == [3, 1, 1, 1]
    for req, out in zip(reqs, outs):
        assert_logprobs_match(reference_model, req, out)


# ---------------------------------------------------------------- stops and lengths


async def test_max_new_tokens_and_stop_token_ids(engine: TransformersEngine) -> None:
    free = (await generate_all(engine, request("free", temperature=0.0, max_new_tokens=12, ignore_eos=True)))[0]
    tokens = free.samples[0].token_ids
    assert len(tokens) == 12 and free.samples[0].finish_reason == "length"

    stop_token = tokens[3]
    cut = tokens.index(stop_token)
    stopped = (await generate_all(engine, request("stopped", temperature=0.0, max_new_tokens=12,
                                                  stop_token_ids=(stop_token,))))[0]
    assert stopped.samples[0].token_ids == tokens[: cut + 1]  # the stop token is kept
    assert stopped.samples[0].finish_reason == "stop"

    held = (await generate_all(engine, request("held", temperature=0.0, max_new_tokens=12, min_new_tokens=cut + 2,
                                               stop_token_ids=(stop_token,))))[0]
    assert len(held.samples[0].token_ids) >= cut + 2
    assert stop_token not in held.samples[0].token_ids[: cut + 1]

    empty = (await generate_all(engine, request("none", n=2, max_new_tokens=0)))[0]
    assert [(s.token_ids, s.logprobs, s.finish_reason) for s in empty.samples] == [([], [], "length")] * 2


async def test_eos_stops_unless_ignored(engine: TransformersEngine) -> None:
    # eos is rare per step, so many hot samples: at least one must end on eos, and ignore_eos must never.
    normal, ignoring = await generate_all(
        engine,
        request("eos", temperature=1.5, n=8, max_new_tokens=64, sampling_seed=5),
        request("noeos", temperature=1.5, n=8, max_new_tokens=64, sampling_seed=5, ignore_eos=True),
    )
    ended = [s for s in normal.samples if s.finish_reason == "stop"]
    assert ended and all(s.token_ids[-1] == EOS_ID for s in ended)
    assert all(s.finish_reason == "length" and len(s.token_ids) == 64 for s in ignoring.samples)


async def test_stop_strings(engine: TransformersEngine) -> None:
    free = (await generate_all(engine, request("text", temperature=0.0, max_new_tokens=24, ignore_eos=True)))[0]
    tokens = free.samples[0].token_ids
    ascii_positions = [i for i, t in enumerate(tokens) if t < 128]
    assert ascii_positions, "the greedy continuation should contain an ASCII byte"
    first = ascii_positions[0]
    stop = chr(tokens[first])
    out = (await generate_all(engine, request("cut", temperature=0.0, max_new_tokens=24, stop=(stop,))))[0]
    assert out.samples[0].token_ids == tokens[: first + 1]
    assert out.samples[0].finish_reason == "stop"


# ---------------------------------------------------------------- abort


async def test_abort_running_returns_partial_and_batch_continues(
    engine: TransformersEngine, reference_model: Any
) -> None:
    long = request("long", temperature=1.0, max_new_tokens=1500, ignore_eos=True, sampling_seed=1)
    medium = request("medium", [7, 8], temperature=1.0, max_new_tokens=200, ignore_eos=True)
    running = asyncio.ensure_future(generate_all(engine, long, medium))
    await wait_for_progress(engine, "long", 3)
    engine.abort("long")
    engine.abort("no-such-handle")  # ignored
    long_out, medium_out = await asyncio.wait_for(running, 30)
    partial = long_out.samples[0]
    assert partial.finish_reason == "abort" and long_out.aborted
    assert 3 <= len(partial.token_ids) < 1500
    assert_logprobs_match(reference_model, long, long_out)
    assert medium_out.samples[0].finish_reason == "length" and len(medium_out.samples[0].token_ids) == 200


async def test_abort_queued_returns_at_once(engine: TransformersEngine) -> None:
    blocking = request("blocker", max_new_tokens=1500, ignore_eos=True)
    blocker = asyncio.ensure_future(engine.generate(blocking, "blocker"))
    await wait_for_progress(engine, "blocker", 1)
    queued = asyncio.ensure_future(engine.generate(request("queued", n=2), "queued"))
    await asyncio.sleep(0.01)
    assert engine.progress("queued") == 0 and not queued.done()
    engine.abort("queued")
    out = await asyncio.wait_for(queued, 1)
    assert [(s.token_ids, s.logprobs, s.finish_reason) for s in out.samples] == [([], [], "abort")] * 2
    engine.abort("blocker")
    blocked = await asyncio.wait_for(blocker, 10)
    assert blocked.samples[0].finish_reason == "abort"


async def test_cancelled_generate_aborts_and_engine_keeps_serving(engine: TransformersEngine) -> None:
    task = asyncio.ensure_future(engine.generate(request("cancel", max_new_tokens=1500, ignore_eos=True), "cancel"))
    await wait_for_progress(engine, "cancel", 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.progress("cancel") is None
    out = await asyncio.wait_for(engine.generate(request("after", max_new_tokens=3, ignore_eos=True), "after"), 10)
    assert len(out.samples[0].token_ids) == 3


# ---------------------------------------------------------------- validation and prompts


async def test_validate_rejects_bad_requests(engine: TransformersEngine) -> None:
    cases = {
        "input_ids[1]": request("oov", [1, 259]),
        "sampling_params.stop_token_ids[0]": request("oovstop", stop_token_ids=(400,)),
        "sampling_params.max_new_tokens": request("long_ids", [1] * 2000, max_new_tokens=100),
        "sampling_params.repetition_penalty": request("penalty", repetition_penalty=1.2),
    }
    for field_name, req in cases.items():
        with pytest.raises(ValidationError) as info:
            engine.validate(req)
        assert info.value.field == field_name
    with pytest.raises(ValidationError):
        await engine.generate(request("oov2", [1, 300]), "oov2")
    fits = GenerationRequest(request_id="ok", prompt="a" * 1900, sampling_params=SamplingParams(max_new_tokens=100))
    engine.validate(fits)


async def test_a_context_overflow_names_max_new_tokens_and_the_numbers_for_text_and_token_prompts(
        engine: TransformersEngine) -> None:
    # The tiny model's context is 2048 tokens; its tokenizer makes one token per byte.
    by_text = GenerationRequest(request_id="text", prompt="a" * 2000, sampling_params=SamplingParams(max_new_tokens=100))
    by_ids = request("ids", [97] * 2000, max_new_tokens=100)
    for req in (by_text, by_ids):
        with pytest.raises(ValidationError) as info:
            engine.validate(req)
        assert info.value.field == "sampling_params.max_new_tokens", req.request_id
        assert info.value.rule == ("prompt (2000 tokens) + max_new_tokens (100) exceeds the model context of 2048: "
                                   "at most 48 new tokens fit")
    # A prompt that fills the context alone is the prompt's fault, whatever max_new_tokens says.
    full_text = GenerationRequest(request_id="full", prompt="a" * 2048, sampling_params=SamplingParams(max_new_tokens=1))
    for req, field_name in ((full_text, "prompt"), (request("full_ids", [97] * 2048, max_new_tokens=1), "input_ids")):
        with pytest.raises(ValidationError) as info:
            engine.validate(req)
        assert (info.value.field, info.value.rule) == (
            field_name, "the prompt (2048 tokens) leaves no room in the model context of 2048")


async def test_prompt_requests_match_token_requests(engine: TransformersEngine) -> None:
    text = "Hello, wörld"
    by_prompt = GenerationRequest(request_id="p", prompt=text, return_logprob=True,
                                  sampling_params=SamplingParams(temperature=0.0, max_new_tokens=8))
    by_ids = request("i", list(text.encode()), temperature=0.0, max_new_tokens=8)
    out_prompt, out_ids = await generate_all(engine, by_prompt, by_ids)
    assert out_prompt.prompt_tokens == len(text.encode()) == out_ids.prompt_tokens
    assert out_prompt.samples[0].token_ids == out_ids.samples[0].token_ids
    assert out_prompt.samples[0].logprobs == pytest.approx(out_ids.samples[0].logprobs, abs=LOGPROB_TOLERANCE)


async def test_logprobs_omitted_unless_asked(engine: TransformersEngine) -> None:
    out = (await generate_all(engine, request("nolp", logprobs=False, max_new_tokens=3, ignore_eos=True)))[0]
    assert out.samples[0].logprobs is None and len(out.samples[0].token_ids) == 3


async def test_local_hugging_face_directory(tmp_path: Path, reference_model: Any) -> None:
    """A saved model + fast tokenizer load through the Auto classes (no hub access needed)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {(chr(i) if chr(i).isalnum() else f"<0x{i:02X}>"): i for i in range(256)}
    vocab |= {"<s>": 256, "</s>": 257, "<pad>": 258}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.save_pretrained(tmp_path)
    reference_model.save_pretrained(tmp_path)

    eng = TransformersEngine(str(tmp_path), weight_version="7")
    await eng.start()
    try:
        assert (eng.info.vocab_size, eng.info.eos_token_id, eng.info.max_context) == (259, 257, 2048)
        req = GenerationRequest(request_id="hf", prompt="hello", return_logprob=True,
                                sampling_params=SamplingParams(temperature=0.8, max_new_tokens=10, sampling_seed=1))
        out = await eng.generate(req, "hf")
    finally:
        await eng.close()
    assert out.prompt_tokens == 5 and out.weight_version == "7"
    prompt_ids = list(b"hello")
    expected = teacher_forced_logprobs(reference_model, prompt_ids, out.samples[0].token_ids, 0.8)
    assert out.samples[0].logprobs == pytest.approx(expected, abs=LOGPROB_TOLERANCE)


# ---------------------------------------------------------------- per-request extras


async def test_top_logprobs_are_the_k_most_likely_of_the_same_distribution(engine, reference_model):
    req = GenerationRequest(request_id="top", input_ids=[72, 105, 33], return_logprob=True, top_logprobs_num=4,
                            sampling_params=SamplingParams(max_new_tokens=6, temperature=0.7, sampling_seed=3))
    plain = request("plain", max_new_tokens=6)
    top_out, plain_out = await generate_all(engine, req, plain)  # (one batch: only one asked)
    sample = top_out.samples[0]
    assert len(sample.top_logprobs) == len(sample.token_ids) == 6 and plain_out.samples[0].top_logprobs is None
    ids = [72, 105, 33]
    for position, (token, logprob, top) in enumerate(zip(sample.token_ids, sample.logprobs, sample.top_logprobs)):
        assert len(top) == 4 and [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        logits = reference_model(torch.tensor([ids + sample.token_ids[:position]])).logits[0, -1]
        want = torch.log_softmax(logits.float() / 0.7, -1).topk(4)
        assert [t for t, _ in top] == want.indices.tolist()
        assert max(abs(a - b) for (_, a), b in zip(top, want.values.tolist())) < LOGPROB_TOLERANCE
        if token in dict(top):
            assert abs(dict(top)[token] - logprob) < LOGPROB_TOLERANCE


async def test_prompt_logprobs_from_logprob_start_len_match_a_teacher_forced_pass(engine, reference_model):
    prompt = [72, 105, 33, 50, 60]
    short = GenerationRequest(request_id="p0", input_ids=prompt[:2], return_logprob=True, logprob_start_len=0,
                              sampling_params=SamplingParams(max_new_tokens=2))
    long = GenerationRequest(request_id="p2", input_ids=prompt, return_logprob=True, logprob_start_len=2,
                             sampling_params=SamplingParams(max_new_tokens=2, temperature=0.5, n=2))
    short_out, long_out = await generate_all(engine, short, long)  # (left-padded together)
    want = teacher_forced_logprobs(reference_model, prompt[:1], prompt[1:], 0.5)
    assert long_out.input_logprobs[0] == pytest.approx(want[1], abs=LOGPROB_TOLERANCE)
    assert len(long_out.input_logprobs) == 3
    assert max(abs(a - b) for a, b in zip(long_out.input_logprobs, want[1:])) < LOGPROB_TOLERANCE
    want_short = teacher_forced_logprobs(reference_model, prompt[:1], prompt[1:2], 1.0)
    assert short_out.input_logprobs[0] is None
    assert abs(short_out.input_logprobs[1] - want_short[0]) < LOGPROB_TOLERANCE


async def test_routed_experts_are_refused_by_a_dense_model(engine):
    req = GenerationRequest(request_id="moe", input_ids=[72], return_routed_experts=True)
    with pytest.raises(ValidationError) as ei:
        engine.validate(req)
    assert ei.value.field == "return_routed_experts"
