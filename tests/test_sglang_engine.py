"""The SGLang adapter against the 0.5.x stand-in (tests/sglang_standin.py): mapping, rids, aborts, errors,
weights, memory, and the real worker loop on a real redis-server."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from redroll.engine_worker.engines.base import EngineOutput
from redroll.engine_worker.engines.sglang_engine import EngineRequestError, SGLangEngine, WeightUpdateError
from redroll.shared.codec import ValidationError
from redroll.shared.types import GenerationRequest, RecordStatus, SamplingParams
from tests import sglang_standin as sgl
from tests.conftest import ROOT, wait_until


def req(request_id: str = "r1", *, input_ids=None, prompt=None, n: int = 1, max_new_tokens: int = 8,
        return_logprob: bool = False, lora_path=None, **sampling) -> GenerationRequest:
    if input_ids is None and prompt is None:
        input_ids = [5, 6, 7]
    return GenerationRequest(request_id=request_id, input_ids=input_ids, prompt=prompt,
                             sampling_params=SamplingParams(max_new_tokens=max_new_tokens, n=n, **sampling),
                             return_logprob=return_logprob, lora_path=lora_path)


async def started(options: dict | None = None, **kwargs) -> SGLangEngine:
    factory = sgl.Engine.with_options(**(options or {}))
    engine = SGLangEngine("/models/tiny", engine_factory=factory, **kwargs)
    await engine.start()
    return engine


def stepping_tokens(prompt_ids, position, seed, vocab):
    """Token = 100 + position (and never a special id), for predictable stops."""
    return 100 + position


def scheduler(engine: SGLangEngine) -> sgl.StandInScheduler:
    return engine.engine.tokenizer_manager.scheduler


def is_prefix_free(rids) -> bool:
    rids = list(rids)
    return not any(a != b and b.startswith(a) for a in rids for b in rids)


# --------------------------------------------------------------------------- construction and info


def test_module_imports_without_sglang():
    code = ("import sys\nfor m in ('torch', 'transformers', 'sglang'):\n    sys.modules[m] = None\n"
            "import asyncio\n"
            "from redroll.engine_worker.engines.sglang_engine import SGLangEngine\n"
            "from redroll.engine_worker.engines import create_engine\n"
            "e = create_engine('sglang', model_path='/m', weight_version='w')\n"
            "assert isinstance(e, SGLangEngine) and e.info.weight_version == 'w'\n"
            "try:\n    asyncio.run(e.start())\nexcept ImportError:\n    print('no sglang')\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no sglang" in proc.stdout


async def test_constructor_passes_only_set_kwargs_and_extra_args():
    engine = await started(max_running_requests=8, random_seed=3,
                           extra_args={"chunked_prefill_size": 4096, "enable_lora": True})
    try:
        assert engine.engine.kwargs == {
            "model_path": "/models/tiny", "tp_size": 1, "dp_size": 1, "dtype": "auto",
            "enable_memory_saver": False, "skip_tokenizer_init": False, "max_running_requests": 8,
            "random_seed": 3, "chunked_prefill_size": 4096, "enable_lora": True}
        for unset in ("mem_fraction_static", "context_length", "weight_version"):
            assert unset not in engine.engine.kwargs
    finally:
        await engine.close()
    assert engine.engine is None
    with pytest.raises(ValueError, match="tp_size"):
        SGLangEngine("/m", tp_size=2, extra_args={"tp_size": 4})


async def test_info_from_tokenizer_manager_and_server_args():
    engine = await started({"vocab_size": 500, "model_context_len": 300})
    try:
        info = engine.info
        assert (info.name, info.model, info.vocab_size, info.max_context) == ("sglang", "/models/tiny", 500, 300)
        assert (info.eos_token_id, info.pad_token_id) == (2, 0)
        assert info.weight_version == "default"  # server_args.py: weight_version = "default"
        assert engine.tokenizer is not None and engine.tokenizer.decode(engine.tokenizer.encode("hi")) == "hi"
    finally:
        await engine.close()
    engine = await started(weight_version="w7", context_length=128)
    try:
        assert engine.engine.kwargs["weight_version"] == "w7" and engine.info.weight_version == "w7"
        assert engine.info.max_context == 128
    finally:
        await engine.close()


async def test_validate_refuses_what_sglang_refuses():
    engine = await started({"vocab_size": 500, "model_context_len": 64, "max_req_input_len": 40},
                           skip_tokenizer_init=True)
    try:
        assert engine.tokenizer is None
        engine.validate(req(input_ids=[1] * 10, max_new_tokens=8))
        with pytest.raises(ValidationError, match="input_ids"):
            engine.validate(req(input_ids=[1, 600]))  # outside the vocabulary
        with pytest.raises(ValidationError, match="max_new_tokens"):
            engine.validate(req(input_ids=[1] * 32, max_new_tokens=32))  # == context: SGLang's ">="
        with pytest.raises(ValidationError, match="maximum allowed length"):
            engine.validate(req(input_ids=[1] * 40, max_new_tokens=1))  # the scheduler's limit
        with pytest.raises(ValidationError, match="skip_tokenizer_init"):
            engine.validate(req(prompt="hello"))
        with pytest.raises(ValidationError, match="LoRA"):
            engine.validate(req(lora_path="adapter-a"))
    finally:
        await engine.close()


# --------------------------------------------------------------------------- output mapping


async def test_stop_length_and_eos_mapping():
    engine = await started({"token_fn": stepping_tokens})
    try:
        out = await engine.generate(req(max_new_tokens=10, stop_token_ids=(103,)), "h-stop")
        assert out.samples[0].token_ids == [100, 101, 102, 103] and out.samples[0].finish_reason == "stop"
        out = await engine.generate(req(max_new_tokens=5), "h-len")
        assert out.samples[0].token_ids == [100, 101, 102, 103, 104] and out.samples[0].finish_reason == "length"
        # schedule_batch.py check_finished: length is checked before stop tokens
        out = await engine.generate(req(max_new_tokens=4, stop_token_ids=(103,)), "h-both")
        assert out.samples[0].finish_reason == "length"
        assert not out.aborted and out.prompt_tokens == 3
    finally:
        await engine.close()

    eos_at_2 = lambda ids, pos, seed, vocab: 2 if pos == 2 else 50  # noqa: E731
    engine = await started({"token_fn": eos_at_2})
    try:
        out = await engine.generate(req(max_new_tokens=6), "h-eos")
        assert out.samples[0].token_ids == [50, 50, 2] and out.samples[0].finish_reason == "stop"
        out = await engine.generate(req(max_new_tokens=6, ignore_eos=True), "h-ignore")
        assert len(out.samples[0].token_ids) == 6 and out.samples[0].finish_reason == "length"
    finally:
        await engine.close()


async def test_logprob_tuples_become_floats_aligned_with_ids():
    engine = await started()
    try:
        out = await engine.generate(req(max_new_tokens=7, return_logprob=True), "h-lp")
        s = out.samples[0]
        assert len(s.token_ids) == 7 and len(s.logprobs) == 7
        assert all(isinstance(x, float) for x in s.logprobs)
        assert s.logprobs == [sgl.token_logprob(t, i) for i, t in enumerate(s.token_ids)]
        out = await engine.generate(req(max_new_tokens=3), "h-nolp")
        assert out.samples[0].logprobs is None
        assert out.weight_version == "default" and out.extra["e2e_latency"] >= 0
        raw = engine.engine.calls[0]
        assert raw["return_logprob"] is True
    finally:
        await engine.close()


async def test_prompt_vs_input_ids_and_cached_tokens():
    engine = await started()
    try:
        out = await engine.generate(req(prompt="hello world", max_new_tokens=2), "h-p")
        call = engine.engine.calls[-1]
        assert call["prompt"] == "hello world" and call["input_ids"] is None
        assert out.prompt_tokens == len("hello world") and out.cached_tokens == 0
        out = await engine.generate(req(input_ids=[9, 8, 7, 6], max_new_tokens=2), "h-ids")
        call = engine.engine.calls[-1]
        assert call["input_ids"] == [9, 8, 7, 6] and call["prompt"] is None and out.prompt_tokens == 4
        out = await engine.generate(req(input_ids=[9, 8, 7, 6], max_new_tokens=2), "h-ids-again")
        assert out.cached_tokens == 3  # the radix cache keeps at most len - 1
        assert "n" not in call["sampling_params"] and call["sampling_params"]["max_new_tokens"] == 2
    finally:
        await engine.close()


async def test_n_samples_are_separate_calls_with_prefix_free_fixed_width_rids():
    engine = await started()
    try:
        out = await engine.generate(req(n=4, max_new_tokens=5, return_logprob=True, sampling_seed=11), "h-n4")
        calls = engine.engine.calls
        assert len(calls) == 4 and len(out.samples) == 4
        rids = [c["rid"] for c in calls]
        assert len(set(rids)) == 4 and is_prefix_free(rids)
        assert all("n" not in c["sampling_params"] for c in calls)
        assert sorted(c["sampling_params"]["sampling_seed"] for c in calls) == [11, 12, 13, 14]
        assert all(len(s.token_ids) == 5 == len(s.logprobs) for s in out.samples)
        assert len({tuple(s.token_ids) for s in out.samples}) == 4  # distinct seeds, distinct samples
        for i in range(12):  # more handles, more samples: every rid has the same width
            await engine.generate(req(n=11, max_new_tokens=1), f"h-more-{i}")
        all_rids = [c["rid"] for c in engine.engine.calls]
        assert len({len(r) for r in all_rids}) == 1
        assert len(set(all_rids)) == len(all_rids) and is_prefix_free(all_rids)
    finally:
        await engine.close()


async def test_lora_path_is_passed():
    engine = await started(extra_args={"lora_paths": ["adapter-a=/loras/a"]})
    try:
        engine.validate(req(lora_path="adapter-a"))
        await engine.generate(req(lora_path="adapter-a", max_new_tokens=1), "h-lora")
        assert engine.engine.calls[-1]["lora_path"] == "adapter-a"
        await engine.generate(req(max_new_tokens=1), "h-nolora")
        assert engine.engine.calls[-1]["lora_path"] is None
    finally:
        await engine.close()


# --------------------------------------------------------------------------- SGLang's own n > 1


async def test_sglang_parallel_sampling_hides_the_rids_and_cannot_be_aborted():
    """Why the adapter never passes n: SGLang gives each sample a fresh uuid rid (tokenizer_manager.py
    _handle_batch_request / io_struct.py regenerate_rid), so aborting the caller's rid hits nothing."""
    engine = sgl.Engine.with_options(token_delay_s=0.005)(model_path="/m")
    try:
        task = asyncio.ensure_future(engine.async_generate(input_ids=[1, 2, 3], rid="X",
                                                           sampling_params={"n": 3, "max_new_tokens": 40}))
        tm = engine.tokenizer_manager
        await wait_until(lambda: len(tm.scheduler.running) == 3, timeout=5)
        tm.abort_request("X")
        tm.abort_request("X_0")
        outs = await asyncio.wait_for(task, 5)
        assert isinstance(outs, list) and len(outs) == 3
        ids = [o["meta_info"]["id"] for o in outs]
        assert all(not i.startswith("X") and len(i) == 32 for i in ids)
        assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["length"] * 3
    finally:
        engine.shutdown()


# --------------------------------------------------------------------------- aborts


async def test_abort_of_a_queued_request():
    engine = await started({"token_delay_s": 0.005}, max_running_requests=1)
    try:
        running = asyncio.ensure_future(engine.generate(req("a", max_new_tokens=400), "h-run"))
        queued = asyncio.ensure_future(engine.generate(req("b", input_ids=[1, 2, 3, 4], max_new_tokens=50,
                                                           return_logprob=True), "h-queued"))
        sched = scheduler(engine)
        await wait_until(lambda: len(sched.running) == 1 and len(sched.waiting_queue) == 1, timeout=5)
        engine.abort("h-queued")
        out: EngineOutput = await asyncio.wait_for(queued, 5)
        s = out.samples[0]
        assert (s.token_ids, s.logprobs, s.finish_reason) == ([], [], "abort") and out.aborted
        assert out.prompt_tokens == 4  # meta_info of a waiting-queue abort has no prompt_tokens
        assert out.weight_version == "default"
        assert not running.done()
        engine.abort("h-run")
        out = await asyncio.wait_for(running, 5)
        assert out.samples[0].finish_reason == "abort" and 0 < len(out.samples[0].token_ids) < 400
    finally:
        await engine.close()


async def test_abort_of_a_running_request_keeps_partial_tokens_and_logprobs():
    engine = await started({"token_delay_s": 0.005})
    try:
        task = asyncio.ensure_future(engine.generate(req(max_new_tokens=1000, return_logprob=True), "h-long"))
        sched = scheduler(engine)
        await wait_until(lambda: sched.forward_passes >= 5, timeout=5)
        started_at = time.monotonic()
        engine.abort("h-long")
        out = await asyncio.wait_for(task, 5)
        assert time.monotonic() - started_at < 1.0
        s = out.samples[0]
        assert s.finish_reason == "abort" and out.aborted
        assert 5 <= len(s.token_ids) < 1000 and len(s.logprobs) == len(s.token_ids)
        assert s.logprobs == [sgl.token_logprob(t, i) for i, t in enumerate(s.token_ids)]
        assert out.prompt_tokens == 3  # a running abort goes through _handle_batch_output
    finally:
        await engine.close()


async def test_abort_stops_all_samples_queued_or_running():
    engine = await started({"token_delay_s": 0.005}, max_running_requests=2)
    try:
        task = asyncio.ensure_future(engine.generate(req(n=4, max_new_tokens=1000), "h-n"))
        sched = scheduler(engine)
        await wait_until(lambda: len(sched.running) == 2 and len(sched.waiting_queue) == 2, timeout=5)
        engine.abort("h-n")
        out = await asyncio.wait_for(task, 5)
        assert [s.finish_reason for s in out.samples] == ["abort"] * 4
        assert sorted(len(s.token_ids) > 0 for s in out.samples) == [False, False, True, True]
        assert not sched.running and not sched.waiting_queue
    finally:
        await engine.close()


async def test_prefix_abort_never_hits_a_sibling_or_another_handle():
    # The hazard, on the stand-in's scheduler directly: rids X_0..X_11, abort "X_1" -> X_1, X_10, X_11 stop.
    engine = sgl.Engine.with_options(token_delay_s=0.005)(model_path="/m")
    try:
        tasks = {f"X_{i}": asyncio.ensure_future(engine.async_generate(
            input_ids=[1, 2], rid=f"X_{i}", sampling_params={"max_new_tokens": 200})) for i in range(12)}
        await wait_until(lambda: len(engine.tokenizer_manager.scheduler.running) == 12, timeout=5)
        engine.tokenizer_manager.abort_request("X_1")
        results = {rid: (await asyncio.wait_for(t, 5))["meta_info"]["finish_reason"]["type"]
                   for rid, t in tasks.items()}
        assert sorted(r for r, kind in results.items() if kind == "abort") == ["X_1", "X_10", "X_11"]
    finally:
        engine.shutdown()

    # The adapter: 12 samples per handle, two handles at once; every abort matches exactly one request.
    engine = await started({"token_delay_s": 0.005})
    try:
        sched = scheduler(engine)
        matches: list[int] = []
        original = sched.abort_request

        def counting_abort(recv_req):
            matches.append(sum(r.rid.startswith(recv_req.rid) for r in sched.running + sched.waiting_queue))
            original(recv_req)

        sched.abort_request = counting_abort
        a = asyncio.ensure_future(engine.generate(req("a", n=12, max_new_tokens=40), "1-1.1"))
        b = asyncio.ensure_future(engine.generate(req("b", n=12, max_new_tokens=40), "1-1.10"))
        await wait_until(lambda: len(sched.running) == 24, timeout=5)
        engine.abort("1-1.1")
        out_a, out_b = await asyncio.wait_for(asyncio.gather(a, b), 10)
        assert [s.finish_reason for s in out_a.samples] == ["abort"] * 12
        assert [s.finish_reason for s in out_b.samples] == ["length"] * 12
        assert [len(s.token_ids) for s in out_b.samples] == [40] * 12
        assert matches and set(matches) <= {0, 1} and matches.count(1) == 12
    finally:
        await engine.close()


async def test_abort_of_an_unknown_handle_is_a_no_op():
    engine = await started()
    try:
        engine.abort("never-seen")
        assert engine.engine.tokenizer_manager.abort_calls == []
        out = await engine.generate(req(max_new_tokens=3), "other")
        assert out.samples[0].finish_reason == "length"
    finally:
        await engine.close()


async def test_abort_before_generate_starts_nothing():
    engine = await started()
    try:
        engine.abort("early")
        out = await engine.generate(req(n=3, max_new_tokens=5, return_logprob=True), "early")
        assert engine.engine.calls == []
        assert [(s.token_ids, s.logprobs, s.finish_reason) for s in out.samples] == [([], [], "abort")] * 3
        assert out.aborted and out.prompt_tokens == 3
    finally:
        await engine.close()


async def test_abort_lost_while_tokenizing_is_re_sent():
    """An abort that reaches the scheduler before the request (tokenize window) is dropped by SGLang;
    the adapter keeps re-sending it until the sample's call returns."""
    engine = await started({"token_delay_s": 0.005, "tokenize_delay_s": 0.05})
    try:
        task = asyncio.ensure_future(engine.generate(req(max_new_tokens=2000), "h-race"))
        await asyncio.sleep(0.01)  # inside the tokenize window: rid registered, scheduler empty
        engine.abort("h-race")
        out = await asyncio.wait_for(task, 5)
        assert out.samples[0].finish_reason == "abort" and len(out.samples[0].token_ids) < 2000
        calls = engine.engine.tokenizer_manager.abort_calls
        assert len(calls) >= 2 and len({rid for rid, _ in calls}) == 1
        assert not any(abort_all for _, abort_all in calls)
    finally:
        await engine.close()


async def test_cancelled_generate_aborts_in_sglang():
    engine = await started({"token_delay_s": 0.005})
    try:
        task = asyncio.ensure_future(engine.generate(req(n=2, max_new_tokens=2000), "h-cancel"))
        sched = scheduler(engine)
        await wait_until(lambda: len(sched.running) == 2, timeout=5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: not sched.running and not engine.engine.tokenizer_manager.rid_to_state, timeout=5)
    finally:
        await engine.close()


# --------------------------------------------------------------------------- errors


async def test_400_error_abort_raises_engine_request_error_not_a_hang():
    engine = await started({"max_req_input_len": 4})
    try:
        with pytest.raises(EngineRequestError, match=r"Input length \(5 tokens\) exceeds") as err:
            await asyncio.wait_for(engine.generate(req(input_ids=[1, 2, 3, 4, 5]), "h-400"), 5)
        assert err.value.status_code == 400
        assert engine.engine.tokenizer_manager.rid_to_state == {}
    finally:
        await engine.close()


async def test_tokenizer_manager_validation_error_becomes_engine_request_error():
    engine = await started({"model_context_len": 16})
    try:
        with pytest.raises(EngineRequestError, match="maximum context length of 16 tokens") as err:
            await asyncio.wait_for(engine.generate(req(input_ids=[1] * 8, max_new_tokens=8), "h-ctx"), 5)
        assert err.value.status_code == 400
    finally:
        await engine.close()


async def test_503_queue_full_raises_and_does_not_hang():
    engine = await started({"token_delay_s": 0.005}, max_running_requests=1, extra_args={"max_queued_requests": 1})
    try:
        sched = scheduler(engine)
        first = asyncio.ensure_future(engine.generate(req("a", max_new_tokens=300), "h-1"))
        await wait_until(lambda: len(sched.running) == 1, timeout=5)  # one inbox batch counts as one arrival
        second = asyncio.ensure_future(engine.generate(req("b", max_new_tokens=300), "h-2"))
        await wait_until(lambda: len(sched.running) == 1 and len(sched.waiting_queue) == 1, timeout=5)
        with pytest.raises(EngineRequestError, match="The request queue is full.") as err:
            await asyncio.wait_for(engine.generate(req("c"), "h-3"), 5)
        assert err.value.status_code == 503
        engine.abort("h-1")
        engine.abort("h-2")
        await asyncio.wait_for(asyncio.gather(first, second), 5)
    finally:
        await engine.close()


async def test_one_failing_sample_aborts_its_siblings_and_raises():
    def fail_second(rid: str):
        return (500, "simulated scheduler failure") if rid.endswith("-001") else None

    engine = await started({"token_delay_s": 0.005, "inject_error": fail_second})
    try:
        started_at = time.monotonic()
        with pytest.raises(EngineRequestError, match="simulated scheduler failure") as err:
            await asyncio.wait_for(engine.generate(req(n=3, max_new_tokens=2000), "h-fail"), 5)
        assert err.value.status_code == 500 and time.monotonic() - started_at < 2.0
        sched = scheduler(engine)
        await wait_until(lambda: not sched.running and not sched.waiting_queue, timeout=5)
    finally:
        await engine.close()


async def test_error_after_our_own_abort_is_reported_as_abort():
    # Queue full (503) for a request we had already aborted during its tokenize window.
    engine = await started({"token_delay_s": 0.005, "tokenize_delay_s": 0.05}, max_running_requests=1,
                           extra_args={"max_queued_requests": 1})
    try:
        sched = scheduler(engine)
        first = asyncio.ensure_future(engine.generate(req("a", max_new_tokens=300), "h-1"))
        await wait_until(lambda: len(sched.running) == 1, timeout=5)  # one inbox batch counts as one arrival
        second = asyncio.ensure_future(engine.generate(req("b", max_new_tokens=300), "h-2"))
        await wait_until(lambda: len(sched.running) == 1 and len(sched.waiting_queue) == 1, timeout=5)
        third = asyncio.ensure_future(engine.generate(req("c", max_new_tokens=300, return_logprob=True), "h-3"))
        await asyncio.sleep(0.01)
        engine.abort("h-3")
        out = await asyncio.wait_for(third, 5)
        assert [(s.token_ids, s.logprobs, s.finish_reason) for s in out.samples] == [([], [], "abort")]
        engine.abort("h-1")
        engine.abort("h-2")
        await asyncio.wait_for(asyncio.gather(first, second), 5)
    finally:
        await engine.close()


async def test_an_abort_we_did_not_ask_for_is_an_error():
    engine = await started({"token_delay_s": 0.005})
    try:
        task = asyncio.ensure_future(engine.generate(req(max_new_tokens=2000), "h-foreign"))
        await wait_until(lambda: scheduler(engine).forward_passes >= 2, timeout=5)
        engine.engine.tokenizer_manager.abort_request(abort_all=True)  # e.g. pause_generation(mode="abort")
        with pytest.raises(EngineRequestError, match="not by redroll") as err:
            await asyncio.wait_for(task, 5)
        assert err.value.status_code is None
    finally:
        await engine.close()


async def test_duplicate_rid():
    # SGLang (later 0.5.x tokenizer_manager.py _init_req_state) refuses a live rid.
    engine = sgl.Engine.with_options(token_delay_s=0.005)(model_path="/m")
    try:
        first = asyncio.ensure_future(engine.async_generate(input_ids=[1], rid="dup", sampling_params={"max_new_tokens": 30}))
        await asyncio.sleep(0.01)
        with pytest.raises(ValueError, match="Duplicate request ID detected: dup"):
            await engine.async_generate(input_ids=[1], rid="dup", sampling_params={"max_new_tokens": 1})
        assert (await first)["meta_info"]["finish_reason"]["type"] == "length"
    finally:
        engine.shutdown()

    engine = await started({"token_delay_s": 0.005})
    try:
        # A foreign request holding the rid the adapter will use next -> EngineRequestError, not a crash.
        next_rid = f"{engine._rid_prefix}{1:012d}-000"
        foreign = asyncio.ensure_future(engine.engine.async_generate(
            input_ids=[1], rid=next_rid, sampling_params={"max_new_tokens": 30}))
        await asyncio.sleep(0.01)
        with pytest.raises(EngineRequestError, match="Duplicate request ID detected") as err:
            await engine.generate(req(max_new_tokens=2), "h-dup")
        assert err.value.status_code == 400
        await foreign
        # And the same handle twice at once is refused by the adapter itself.
        one = asyncio.ensure_future(engine.generate(req(max_new_tokens=50), "same"))
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="already generating"):
            await engine.generate(req(max_new_tokens=1), "same")
        engine.abort("same")
        await one
    finally:
        await engine.close()


# --------------------------------------------------------------------------- weights and memory


async def test_weight_update_changes_weight_version_in_outputs():
    engine = await started({"bad_weight_paths": frozenset({"/ckpt/broken"})}, weight_version="v1")
    try:
        assert (await engine.generate(req(max_new_tokens=1), "h-a")).weight_version == "v1"
        message = await engine.update_weights_from_disk("/ckpt/step-2", weight_version="v2")
        assert "Weight version updated to v2" in message
        assert engine.info.weight_version == "v2" and engine.loaded_model_path == "/ckpt/step-2"
        obj = engine.engine.tokenizer_manager.update_calls[-1]
        assert isinstance(obj, sgl.UpdateWeightFromDiskReqInput)
        assert (obj.model_path, obj.weight_version, obj.load_format) == ("/ckpt/step-2", "v2", "auto")
        assert (await engine.generate(req(max_new_tokens=1), "h-b")).weight_version == "v2"
        with pytest.raises(WeightUpdateError, match="Failed to get weights iterator"):
            await engine.update_weights_from_disk("/ckpt/broken", weight_version="v3")
        assert engine.info.weight_version == "v2"
        # The sync Engine wrapper cannot be used inside the running loop (engine.py run_until_complete).
        with pytest.raises(RuntimeError):
            engine.engine.update_weights_from_disk("/ckpt/step-3")
    finally:
        await engine.close()


async def test_weight_update_waits_for_requests_in_flight():
    engine = await started({"token_delay_s": 0.005})
    try:
        gen = asyncio.ensure_future(engine.generate(req(max_new_tokens=30), "h-inflight"))
        await wait_until(lambda: scheduler(engine).forward_passes >= 2, timeout=5)
        await engine.update_weights_from_disk("/ckpt/next", weight_version="v9")
        assert gen.done() and gen.result().weight_version == "default"
        assert len(gen.result().samples[0].token_ids) == 30
    finally:
        await engine.close()


async def test_release_and_resume_memory_reach_the_tokenizer_manager():
    engine = await started(enable_memory_saver=True)
    try:
        await engine.release_memory_occupation()
        await engine.resume_memory_occupation(tags=["weights"])
        await engine.resume_memory_occupation(tags=["kv_cache"])
        assert engine.engine.tokenizer_manager.memory_calls == [
            ("release", None), ("resume", ["weights"]), ("resume", ["kv_cache"])]
    finally:
        await engine.close()


async def test_close_aborts_in_flight_work_and_shuts_the_engine_down():
    engine = await started({"token_delay_s": 0.005})
    inner = engine.engine
    task = asyncio.ensure_future(engine.generate(req(max_new_tokens=3000), "h-close"))
    await wait_until(lambda: len(scheduler(engine).running) == 1, timeout=5)
    await asyncio.wait_for(engine.close(), 5)
    assert task.done() and task.result().samples[0].finish_reason == "abort"
    assert inner.shutdown_called and engine.engine is None
    with pytest.raises(RuntimeError, match="start"):
        await engine.generate(req(), "late")


async def test_start_refuses_an_sglang_without_per_request_rids():
    class Sglang04(sgl.Engine):  # entrypoints/engine.py at 0.4.x: async_generate has no rid
        async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                                 lora_path=None, stream=False):
            raise AssertionError("not reached")

    engine = SGLangEngine("/m", engine_factory=Sglang04)
    with pytest.raises(RuntimeError, match="rid"):
        await engine.start()
    assert Sglang04.instances[-1].shutdown_called and engine.engine is None


# --------------------------------------------------------------------------- the real worker loop


async def test_real_worker_loop_with_the_stand_in(settings, r):
    from redroll.engine_worker.worker import Worker
    from redroll.producer import Producer

    factory = sgl.Engine.with_options(token_delay_s=0.01)
    engine = SGLangEngine("/models/tiny", engine_factory=factory, weight_version="w1", max_running_requests=8)
    worker = Worker(settings, engine, max_inflight=8)
    task = asyncio.create_task(worker.run())
    try:
        async with Producer(settings) as p:
            done = [await p.submit(request_id=f"ok-{i}", input_ids=[3, 4, 5 + i], return_logprob=True,
                                   sampling_params={"n": 2, "max_new_tokens": 6}) for i in range(3)]
            text = await p.submit(request_id="text-1", prompt="hi there", sampling_params={"max_new_tokens": 4})
            long = await p.submit(request_id="long-1", input_ids=[7, 7], return_logprob=True,
                                  collect_unfinished=True, sampling_params={"n": 2, "max_new_tokens": 3000})
            await wait_until(lambda: any(f.request and f.request.request_id == "long-1"
                                         for f in worker.flights), timeout=10)
            await asyncio.sleep(0.2)
            await p.abort(["long-1"])
            records = [await asyncio.wait_for(f, 15) for f in done]
            text_rec = await asyncio.wait_for(text, 15)
            aborted = await asyncio.wait_for(long, 15)
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 15)
    for rec in records:
        assert rec.status is RecordStatus.FINISHED and rec.finish_reasons == ["length", "length"]
        assert [len(x) for x in rec.output_token_ids] == [6, 6] == [len(x) for x in rec.output_logprobs]
        assert rec.meta_info["weight_version"] == "w1" and rec.meta_info["prompt_tokens"] == 3
        assert rec.meta_info["completion_tokens"] == 12 and "e2e_latency" in rec.meta_info
    assert text_rec.status is RecordStatus.FINISHED and text_rec.meta_info["prompt_tokens"] == len("hi there")
    assert aborted.status is RecordStatus.ABORTED and aborted.finish_reasons == ["abort", "abort"]
    assert all(0 < len(ids) < 3000 for ids in aborted.output_token_ids)
    assert [len(x) for x in aborted.output_logprobs] == [len(x) for x in aborted.output_token_ids]
    assert engine.engine is None  # the worker closed it
