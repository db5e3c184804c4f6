"""The SGLang adapter against the 0.5.23 stand-in (tests/sglang_standin/): mapping, rids, aborts, errors,
limits, weights, memory, signals, shutdown, and the real worker loop on a real redis-server.

Each of the defects found by reading sglang 0.5.23 (pinned version, lost aborts, LoRA, the context
limit, SIGTERM, shutdown, memory release/resume, deterministic seeds) has a test here that fails
on the adapter before its fix."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from redroll.engine_worker.engines.base import EngineCommandRefused, EngineOutput, EngineRequestError, WeightUpdateError
from redroll.engine_worker.engines.sglang_engine import SGLangEngine
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
        engine.validate(req(input_ids=[1] * 32, max_new_tokens=32))  # == context: accepted (">", :1358)
        with pytest.raises(ValidationError, match="max_new_tokens"):
            engine.validate(req(input_ids=[1] * 32, max_new_tokens=33))
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
        # schedule_batch.py:2030-2039 update_finish_state: a stop token beats the length cap at the
        # same token (which matters to RL truncation masks)
        out = await engine.generate(req(max_new_tokens=4, stop_token_ids=(103,)), "h-both")
        assert out.samples[0].finish_reason == "stop"
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
        # Only lora_paths given: SGLang leaves the raw field None (arg_groups/lora_hook.py:38-41) and
        # resolves it elsewhere (tokenizer_manager.py:544). The adapter once read the raw field and
        # dead-lettered every LoRA request.
        assert engine.engine.server_args.enable_lora is None
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


async def test_an_abort_while_tokenizing_is_not_lost():
    """SGLang sends one AbortReq per rid and drops the rest (tokenizer_manager.py:2241-2265); one sent
    before the request reached the scheduler (the tokenize window, :926-950) finds nothing there, and
    the request runs to max_new_tokens. The adapter cancels an undispatched call instead: SGLang
    drops its state and sends nothing (:3850-3874)."""
    engine = await started({"token_delay_s": 0.005, "tokenize_delay_s": 0.05})
    try:
        task = asyncio.ensure_future(engine.generate(req(max_new_tokens=2000), "h-race"))
        await asyncio.sleep(0.01)  # inside the tokenize window: rid registered, not dispatched
        tm = engine.engine.tokenizer_manager
        (state,) = tm.rid_to_state.values()
        assert not state.dispatched
        started_at = time.monotonic()
        engine.abort("h-race")
        out = await asyncio.wait_for(task, 5)
        assert time.monotonic() - started_at < 0.5
        assert (out.samples[0].token_ids, out.samples[0].finish_reason) == ([], "abort")
        assert tm.aborts_dispatched == [] and tm.rid_to_state == {} and scheduler(engine).forward_passes == 0
        await asyncio.sleep(0.1)  # nothing reaches the scheduler later either
        assert scheduler(engine).forward_passes == 0
    finally:
        await engine.close()


async def test_an_abort_after_dispatch_is_sent_once_and_lands():
    engine = await started({"token_delay_s": 0.005})
    try:
        task = asyncio.ensure_future(engine.generate(req(n=2, max_new_tokens=2000), "h-once"))
        tm = engine.engine.tokenizer_manager
        await wait_until(lambda: len(scheduler(engine).running) == 2, timeout=5)
        for _ in range(3):
            engine.abort("h-once")  # repeated: SGLang would drop the repeats anyway
        out = await asyncio.wait_for(task, 5)
        assert [s.finish_reason for s in out.samples] == ["abort", "abort"]
        assert sorted(tm.aborts_dispatched) == sorted(set(tm.aborts_dispatched)) and len(tm.aborts_dispatched) == 2
    finally:
        await engine.close()


async def test_what_sglang_does_with_an_early_abort():
    """The hazard itself, on the stand-in directly (what 0.5.23 does): an abort during tokenization
    is dispatched before the request and lost; its repeats are dropped; the request runs to the end."""
    engine = sgl.Engine.with_options(token_delay_s=0.002, tokenize_delay_s=0.05)(model_path="/m")
    tm = engine.tokenizer_manager
    task = asyncio.ensure_future(engine.async_generate(input_ids=[1, 2], rid="early",
                                                       sampling_params={"max_new_tokens": 30}))
    await asyncio.sleep(0.01)
    for _ in range(5):
        tm.abort_request("early")
    out = await asyncio.wait_for(task, 5)
    assert tm.aborts_dispatched == ["early"] and out["meta_info"]["finish_reason"]["type"] == "length"
    assert len(out["output_ids"]) == 30


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
            await asyncio.wait_for(engine.generate(req(input_ids=[1] * 8, max_new_tokens=9), "h-ctx"), 5)
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
        assert not scheduler(engine).running  # the update waited for it (the writer lock)
        out = await asyncio.wait_for(gen, 5)
        assert out.weight_version == "default" and len(out.samples[0].token_ids) == 30
    finally:
        await engine.close()


async def test_release_and_resume_memory_reach_the_tokenizer_manager():
    engine = await started(enable_memory_saver=True)
    try:
        await engine.release_memory_occupation()
        await engine.resume_memory_occupation(tags=["weights"])
        await engine.resume_memory_occupation(tags=["kv_cache"])
        assert engine.released_tags == ["cuda_graph"]
        await engine.resume_memory_occupation()  # the rest
        assert engine.engine.tokenizer_manager.memory_calls == [
            ("release", ["kv_cache", "weights", "cuda_graph"]), ("resume", ["weights"]), ("resume", ["kv_cache"]),
            ("resume", ["cuda_graph"])]
        assert scheduler(engine).crash is None and engine.released_tags == []
    finally:
        await engine.close()


async def test_memory_commands_sglang_would_crash_on_are_refused():
    # Without the memory saver a release frees nothing (utils/torch_memory_saver_adapter.py:156-160).
    engine = await started()
    try:
        with pytest.raises(EngineCommandRefused, match="--enable-memory-saver"):
            await engine.release_memory_occupation()
    finally:
        await engine.close()
    engine = await started({"token_delay_s": 0.005}, enable_memory_saver=True)
    try:
        # Resuming what was never released: a KeyError that kills the scheduler (weight_updater.py:390).
        with pytest.raises(EngineCommandRefused, match="nothing to resume"):
            await engine.resume_memory_occupation()
        with pytest.raises(EngineCommandRefused, match="were not released"):
            await engine.release_memory_occupation(tags=["kv_cache"]) or await engine.resume_memory_occupation(
                tags=["weights"])
        await engine.resume_memory_occupation(tags=["kv_cache"])
        # Releasing while SGLang still holds a request: the idle assert would kill the scheduler
        # (weight_updater.py:339-341); the adapter waits for idle, and refuses after a timeout.
        busy = asyncio.ensure_future(engine.generate(req(max_new_tokens=4000), "h-busy"))
        await wait_until(lambda: len(scheduler(engine).running) == 1, timeout=5)
        with pytest.raises(EngineCommandRefused, match="holds 1 request"):
            await engine.release_memory_occupation(idle_timeout_s=0.2)
        engine.abort("h-busy")
        await busy
        await engine.release_memory_occupation()
        assert scheduler(engine).crash is None and engine.released_tags == ["cuda_graph", "kv_cache", "weights"]
        # What the stand-in (like 0.5.23) does when asked directly: the scheduler dies.
        with pytest.raises(sgl.SchedulerCrash):
            await engine.engine.tokenizer_manager.resume_memory_occupation(
                sgl.ResumeMemoryOccupationReqInput(tags=["not-released"]), None)
    finally:
        await engine.close()


async def test_close_aborts_in_flight_work_and_shuts_the_engine_down():
    engine = await started({"token_delay_s": 0.005})
    inner = engine.engine
    task = asyncio.ensure_future(engine.generate(req(max_new_tokens=3000), "h-close"))
    await wait_until(lambda: len(scheduler(engine).running) == 1, timeout=5)
    await asyncio.wait_for(engine.close(), 5)
    assert task.done() and task.result().samples[0].finish_reason == "abort"
    # Not Engine.shutdown() (it blocks, kills every child of the worker, and is an atexit hook):
    assert inner.shutdown_calls == 0 and inner.killed == [] and engine.engine is None
    assert all(t.done() for t in inner.tokenizer_manager.asyncio_tasks)
    assert inner.tokenizer_manager._subprocess_watchdog.stopped
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
    assert Sglang04.instances[-1].shutdown_calls == 0 and engine.engine is None


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


# --------------------------------------------------------------------------- defects found reading 0.5.23


async def test_at_the_context_limit_sglang_lowers_max_new_tokens_and_the_record_says_so():
    # context 64, scheduler input limit 58 (max_req_len 63: tp_worker.py:568-572). input 10 +
    # max_new 54 == 64 passes the tokenizer (">", :1358); the scheduler lowers max_new_tokens to
    # 63 - 10 - 1 = 52 without a word (scheduler.py:2710): the output says so.
    engine = await started({"model_context_len": 64, "max_req_input_len": 58, "token_fn": stepping_tokens})
    try:
        request = req(input_ids=list(range(10, 20)), max_new_tokens=54)
        engine.validate(request)
        out = await engine.generate(request, "h-clamp")
        assert out.samples[0].finish_reason == "length" and len(out.samples[0].token_ids) == 52
        assert out.extra["max_new_tokens_effective"] == 52
        out = await engine.generate(req(input_ids=[5, 6, 7], max_new_tokens=8), "h-room")
        assert "max_new_tokens_effective" not in out.extra
        # Reserved (speculative) tokens count against the context on the tokenizer side (:1334-1335).
    finally:
        await engine.close()
    engine = await started({"model_context_len": 64, "num_reserved_tokens": 4})
    try:
        engine.validate(req(input_ids=[1] * 30, max_new_tokens=30))
        with pytest.raises(ValidationError, match="exceeds the model's context length"):
            engine.validate(req(input_ids=[1] * 30, max_new_tokens=31))
    finally:
        await engine.close()


async def test_deterministic_inference_gives_every_sample_its_own_seed():
    # With --enable-deterministic-inference SGLang gives every unseeded request seed 42
    # (sampling_batch_info.py:157-172): n samples of a group would all be the same.
    raw = sgl.Engine.with_options()(model_path="/m", enable_deterministic_inference=True)
    a = await raw.async_generate(input_ids=[1, 2], rid="u-1", sampling_params={"max_new_tokens": 8})
    b = await raw.async_generate(input_ids=[1, 2], rid="u-2", sampling_params={"max_new_tokens": 8})
    assert a["output_ids"] == b["output_ids"]
    engine = await started(extra_args={"enable_deterministic_inference": True})
    try:
        out = await engine.generate(req(n=4, max_new_tokens=8), "h-det")
        assert len({tuple(s.token_ids) for s in out.samples}) == 4
        seeds = out.extra["sampling_seeds"]
        assert len(set(seeds)) == 4 and [c["sampling_params"]["sampling_seed"] for c in engine.engine.calls] == seeds
        seeded = await engine.generate(req(n=2, max_new_tokens=8, sampling_seed=7), "h-seeded")
        again = await engine.generate(req(n=2, max_new_tokens=8, sampling_seed=7), "h-seeded-2")
        assert [s.token_ids for s in seeded.samples] == [s.token_ids for s in again.samples]
        assert seeded.extra["sampling_seeds"] == [7, 8]
    finally:
        await engine.close()


async def test_close_keeps_the_loop_running_and_the_workers_own_children_alive():
    # Engine.shutdown() blocks the loop and SIGKILLs every child of the process
    # (entrypoints/engine.py:1450-1497): the adapter kills only SGLang's own, off the loop.
    ours = subprocess.Popen(["sleep", "60"])
    sglangs = subprocess.Popen(["sleep", "60"])
    try:
        engine = await started({"child_pids": (sglangs.pid,)})
        ticks: list[float] = []

        async def ticker() -> None:
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        tick_task = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        inner = engine.engine
        await asyncio.wait_for(engine.close(), 10)
        tick_task.cancel()
        gaps = [b - a for a, b in zip(ticks, ticks[1:])]
        assert max(gaps) < 0.2, f"the event loop stalled for {max(gaps):.2f}s"
        assert inner.shutdown_calls == 0 and inner.killed == []
        assert sglangs.poll() is not None  # SGLang's process is gone ...
        assert ours.poll() is None  # ... the worker's own child is not
    finally:
        ours.kill()
        sglangs.kill()
        ours.wait()


@pytest.mark.slow
async def test_sigterm_drains_on_sglang_like_on_the_other_engines(settings, r, tmp_path):
    """SGLang installs its own SIGTERM handler on its first call (tokenizer_manager.py:2453-2459);
    its handler waits for idle, kills every child and exits (:3508-3571): no hand-back, no
    deregistration, and claiming goes on meanwhile. A worker on SGLang must drain as any other."""
    import json as json_

    from redroll.producer.client import make_request, send
    from tests.conftest import spawn

    env = {"PYTHONPATH": f"{ROOT / 'tests' / 'fake_sglang'}{os.pathsep}{ROOT}",
           "REDROLL_STANDIN_OPTIONS": json_.dumps({"token_delay_s": 0.01, "watchdog_interval_s": 0.2})}
    log = tmp_path / "worker.log"
    model = tmp_path / "model"  # (the stand-in loads nothing from it; the worker refuses a directory not there)
    model.mkdir()
    proc = spawn(settings, "worker", "--engine", "sglang", "--model-path", str(model), "--max-inflight", "4",
                 log=log, **env)
    try:
        keys = settings.keys
        await send(settings, r, [make_request(request_id=f"long-{i}", input_ids=[3, 4, i + 5],
                                              sampling_params={"max_new_tokens": 3000}) for i in range(4)])
        await wait_until(lambda: _pending(r, keys, 4), timeout=30)
        await send(settings, r, [make_request(request_id=f"queued-{i}", input_ids=[9, 9], sampling_params={
            "max_new_tokens": 4}) for i in range(4)])
        await asyncio.sleep(0.5)
        proc.terminate()
        started_at = time.monotonic()
        code = await asyncio.to_thread(proc.wait, 30)
        elapsed = time.monotonic() - started_at
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert code == 0, out[-3000:]
    assert elapsed < settings.drain_timeout_s + 8, out[-3000:]
    assert "handed back 4 request(s)" in out, out[-3000:]
    assert await r.hlen(keys.workers) == 0  # deregistered
    pending = await r.xpending_range(keys.requests, "workers", min="-", max="+", count=10)
    assert len(pending) == 4 and all(int(p["time_since_delivered"]) >= settings.claim_idle_ms for p in pending)
    assert await r.xlen(keys.requests) == 8  # the queued ones were never claimed
    assert (await r.xinfo_groups(keys.requests))[0]["entries-read"] == 4


async def _pending(r, keys, n: int) -> bool:
    import redis

    try:
        summary = await r.xpending(keys.requests, "workers")
    except redis.ResponseError:  # no group yet: the worker is still starting
        return False
    return int(summary["pending"]) == n


# --------------------------------------------------------------------------- per-request extras


async def test_top_logprobs_and_prompt_logprobs_are_passed_and_mapped():
    engine = await started()
    request = GenerationRequest(request_id="x", input_ids=[5, 6, 7, 8], return_logprob=True, top_logprobs_num=3,
                                logprob_start_len=1, sampling_params=SamplingParams(max_new_tokens=4, n=2))
    out = await engine.generate(request, "h")
    call = engine.engine.calls[-1]
    assert call["rid"].startswith("rr-")
    sample = out.samples[0]
    assert len(sample.top_logprobs) == 4 and all(len(t) == 3 for t in sample.top_logprobs)
    for token, logprob, top in zip(sample.token_ids, sample.logprobs, sample.top_logprobs):
        assert top[0] == (token, logprob)  # (token id, logprob), most likely first
    assert out.input_logprobs == [sgl.token_logprob(t, i) for i, t in enumerate([6, 7, 8])]
    await engine.close()


async def test_routed_experts_come_back_as_int32_per_token_and_layer():
    engine = await started({"routed_experts": (3, 2)}, extra_args={"enable_return_routed_experts": True})
    out = await engine.generate(GenerationRequest(request_id="m", input_ids=[5, 6, 7], return_routed_experts=True,
                                                  sampling_params=SamplingParams(max_new_tokens=4)), "h")
    experts = out.samples[0].routed_experts
    assert experts.shape == (3 + 4 - 1, 3, 2)  # seqlen - 1 tokens (state_capturer/base.py:183-188)
    assert experts.to_list()[1][2] == [(1 * 7 + 2 * 3 + j) % 64 for j in range(2)]
    await engine.close()


async def test_routed_experts_are_refused_without_the_server_flag_or_over_the_size_rule():
    plain = await started({"routed_experts": (3, 2)})
    with pytest.raises(ValidationError, match="enable_return_routed_experts"):
        plain.validate(GenerationRequest(request_id="m", input_ids=[5], return_routed_experts=True))
    await plain.close()
    moe = await started({"routed_experts": (48, 8)}, extra_args={"enable_return_routed_experts": True},
                        max_routed_experts_bytes=1024 * 1024)
    small = GenerationRequest(request_id="s", input_ids=[5] * 100, return_routed_experts=True,
                              sampling_params=SamplingParams(max_new_tokens=500))
    moe.validate(small)  # 599 x 48 x 8 x 4 = 920 KB
    big = GenerationRequest(request_id="b", input_ids=[5] * 100, return_routed_experts=True,
                            sampling_params=SamplingParams(max_new_tokens=600, n=2))
    with pytest.raises(ValidationError, match=r"2147328 bytes \(699 tokens x 48 layers x 8 experts"):
        moe.validate(big)
    await moe.close()


async def test_extras_reach_the_record_through_the_queue(settings, r):
    from redroll.engine_worker.worker import Worker
    from redroll.producer import Producer

    engine = SGLangEngine("/models/tiny", engine_factory=sgl.Engine.with_options(routed_experts=(2, 2)),
                          extra_args={"enable_return_routed_experts": True})
    worker = Worker(settings, engine, max_inflight=4)
    task = asyncio.create_task(worker.run())
    try:
        async with Producer(settings) as p:
            rec = await asyncio.wait_for(await p.submit(
                input_ids=[3, 4, 5], return_logprob=True, top_logprobs_num=2, logprob_start_len=0,
                return_routed_experts=True, sampling_params={"max_new_tokens": 5, "n": 2}), 15)
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 15)
    assert rec.status is RecordStatus.FINISHED
    assert [len(t) for t in rec.output_top_logprobs] == [5, 5] and len(rec.output_top_logprobs[0][0]) == 2
    assert rec.input_logprobs[0] is None and len(rec.input_logprobs) == 3
    assert [e.shape for e in rec.routed_experts] == [(7, 2, 2), (7, 2, 2)]


# --------------------------------------------------------------------------- resumable requests: streaming


def resumable_req(request_id: str, max_new_tokens: int = 80, **kw) -> GenerationRequest:
    return GenerationRequest(request_id=request_id, input_ids=[4, 5, 6], resumable=True, return_logprob=True,
                             sampling_params=SamplingParams(max_new_tokens=max_new_tokens, sampling_seed=3), **kw)


@pytest.mark.parametrize("incremental", [False, True])
async def test_resumable_requests_stream_so_the_worker_sees_partial_output(incremental):
    engine = await started({"token_delay_s": 0.004, "token_fn": stepping_tokens}, checkpoint_stream_interval=10,
                           extra_args={"incremental_streaming_output": incremental})
    raw = engine.engine
    try:
        plain = await engine.generate(req("plain", input_ids=[4, 5, 6], max_new_tokens=80, return_logprob=True,
                                          sampling_seed=3), "h-plain")
        task = asyncio.ensure_future(engine.generate(resumable_req("res"), "h-res"))
        assert engine.partial("h-plain") is None
        await wait_until(lambda: (engine.partial("h-res") or SimpleNamespace(token_ids=[])).token_ids, 10)
        snap = engine.partial("h-res")
        await wait_until(lambda: len(engine.partial("h-res").token_ids) >= 30, 10)
        later = engine.partial("h-res")
        out = await asyncio.wait_for(task, 10)
    finally:
        await engine.close()
    final = out.samples[0]
    # The same output as without streaming; every snapshot a prefix of it, with aligned logprobs
    # (copies: SGLang's live lists kept growing after each chunk).
    assert final.token_ids == plain.samples[0].token_ids and final.logprobs == plain.samples[0].logprobs
    for s in (snap, later):
        assert s.token_ids == final.token_ids[:len(s.token_ids)] and s.logprobs == final.logprobs[:len(s.logprobs)]
    assert len(snap.token_ids) < len(later.token_ids) < 80 and final.finish_reason == "length"
    assert [c["stream"] for c in raw.calls] == [False, True]
    assert raw.calls[1]["sampling_params"]["stream_interval"] == 10


async def test_a_worker_checkpoints_a_streaming_sglang_request(settings, r):
    from redroll.engine_worker.worker import Worker
    from redroll.producer import Producer
    from redroll.shared.checkpoint_reads import load_checkpoint

    s = settings.with_(checkpoint_tokens=20, checkpoint_interval_s=0.1, checkpoint_min_new_tokens=50)
    factory = sgl.Engine.with_options(token_delay_s=0.005)
    engine = SGLangEngine("/models/tiny", engine_factory=factory, checkpoint_stream_interval=20)
    worker = Worker(s, engine, max_inflight=4)
    async with Producer(s) as p:
        task = asyncio.create_task(worker.run())
        try:
            future = await p.submit(request_id="sg-1", input_ids=[4, 5, 6], resumable=True, return_logprob=True,
                                    sampling_params={"max_new_tokens": 400})
            await wait_until(lambda: worker.stats.checkpoints >= 2, 15)
            cp = await load_checkpoint(r, s.keys, "sg-1")
            record = await asyncio.wait_for(future, 15)
        finally:
            worker.request_stop()
            await asyncio.wait_for(task, 15)
    assert cp is not None and 0 < cp.tokens < 400 and len(cp.logprobs) == cp.tokens
    assert record.status is RecordStatus.FINISHED and record.output_token_ids[0][:cp.tokens] == cp.token_ids
    assert record.output_logprobs[0][:cp.tokens] == cp.logprobs
    assert not await r.exists(s.keys.partial("sg-1"))
