"""The stand-in (tests/sglang_standin/) behaves as sglang 0.5.23 where a difference could hide an
adapter bug. Each behaviour names the 0.5.23 source (under sglang/srt/) it follows."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from tests import sglang_standin as sgl
from tests.conftest import wait_until


def engine(**options):
    return sgl.Engine.with_options(**options)(model_path="/m")


async def gen(e, rid, **sampling):
    sampling.setdefault("max_new_tokens", 8)
    return await e.async_generate(input_ids=[5, 6, 7], rid=rid, sampling_params=sampling)


def test_server_args_refuses_unknown_keywords_and_is_sealed_after_launch():
    # server_args.py:551-563 (msgspec Struct: unknown keyword -> TypeError), :474-496 (sealed).
    with pytest.raises(TypeError, match="Unexpected keyword argument 'no_such_flag'"):
        sgl.Engine(model_path="/m", no_such_flag=1)
    with pytest.raises(TypeError, match="model_path"):
        sgl.Engine(tp_size=1)
    e = sgl.Engine(model_path="/m", lora_paths=["a=/x"])
    with pytest.raises(AttributeError, match="read-only"):
        e.server_args.weight_version = "v2"
    # arg_groups/lora_hook.py:38-41: resolved elsewhere, the field stays None.
    assert e.server_args.enable_lora is None and e.tokenizer_manager.enable_lora is True


async def test_finish_reason_order_stop_string_then_token_then_length():
    # schedule_batch.py:2007-2047 update_finish_state.
    tokens = lambda ids, pos, seed, vocab: [3 + ord("a"), 3 + ord("b"), 2][pos] if pos < 3 else 50  # noqa: E731
    e = engine(token_fn=tokens)
    out = await gen(e, "s1", max_new_tokens=3, stop=["ab"])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "ab"}  # string beats EOS and length
    out = await gen(e, "s2", max_new_tokens=3)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}  # EOS beats length
    out = await gen(e, "s3", max_new_tokens=3, ignore_eos=True)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


async def test_error_statuses_raise_as_in_0_5_23():
    # tokenizer_manager.py:1891-1922: 400 -> ValueError, 401-599 -> HTTPException, no status -> output.
    statuses = {"r400": (400, "bad"), "r401": (401, "unauthorized"), "r599": (599, "odd")}
    e = engine(inject_error=lambda rid: statuses.get(rid))
    with pytest.raises(ValueError, match="bad"):
        await gen(e, "r400")
    for rid, (code, message) in (("r401", statuses["r401"]), ("r599", statuses["r599"])):
        with pytest.raises(sgl.HTTPException) as info:
            await gen(e, rid)
        assert info.value.status_code == code and info.value.detail == message
    task = asyncio.ensure_future(gen(e, "mine", max_new_tokens=500))
    await wait_until(lambda: any(r.rid == "mine" for r in e.tokenizer_manager.scheduler.running))
    e.tokenizer_manager.abort_request("mine")
    out = await task  # a user abort carries no status: an ordinary output
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["meta_info"]["finish_reason"]["status_code"] is None


async def test_meta_info_keys_retractions_and_weight_version_spans():
    # :2507-2513 (num_retractions, never total_retractions); utils/weight_versions.py:90-107.
    e = engine(token_delay_s=0.005)
    task = asyncio.ensure_future(gen(e, "span", max_new_tokens=60))
    await wait_until(lambda: e.tokenizer_manager.scheduler.forward_passes >= 20)
    out_v = await e.tokenizer_manager.update_weights_from_disk(sgl.UpdateWeightFromDiskReqInput(
        model_path="/ckpt", weight_version="v2"), None)
    assert out_v[0] is True and len(out_v) == 3  # (success, message, num_paused_requests): :2288-2322
    out = await task
    meta = out["meta_info"]
    assert meta["num_retractions"] == 0 and "total_retractions" not in meta
    assert {"prompt_tokens", "completion_tokens", "cached_tokens", "weight_version", "e2e_latency"} <= set(meta)
    # (the stand-in's update waits for the reader lock, so the whole request ran on one version)
    spans = meta["weight_versions"]
    assert spans[0]["start"] == 0 and spans[-1]["end"] == 60 and meta["weight_version"] == spans[-1]["version"]
    assert sgl.weight_version_spans(["a", "a", "b"], "b") == [{"version": "a", "start": 0, "end": 2},
                                                              {"version": "b", "start": 2, "end": 3}]
    assert sgl.weight_version_spans([], "c") == [{"version": "c", "start": 0, "end": 0}]


async def test_signal_handlers_are_installed_on_the_first_call():
    # tokenizer_manager.py:2440-2463: on the first call, in the main thread, on the running loop.
    loop = asyncio.get_running_loop()
    seen = []
    loop.add_signal_handler(signal.SIGTERM, seen.append, "mine")
    try:
        e = engine()
        loop._signal_handlers[signal.SIGTERM]._run()  # (asyncio keeps the handle here)
        assert seen == ["mine"]
        await gen(e, "first", max_new_tokens=1)
        loop._signal_handlers[signal.SIGTERM]._run()
        assert seen == ["mine"] and e.tokenizer_manager.gracefully_exit is True
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        loop.remove_signal_handler(signal.SIGQUIT)
        for t in e.tokenizer_manager.asyncio_tasks:
            t.cancel()


def test_shutdown_blocks_and_would_kill_every_child():
    # entrypoints/engine.py:1450-1497 (kill_process_tree of this process, include_parent=False).
    import subprocess

    child = subprocess.Popen(["sleep", "30"])
    try:
        e = engine(shutdown_s=0.2)
        started = time.monotonic()
        e.shutdown()
        assert time.monotonic() - started >= 0.2
        assert child.pid in e.killed and child.poll() is None  # recorded, not done (kill_for_real is off)
    finally:
        child.kill()
        child.wait()


async def test_memory_bookkeeping_crashes_where_the_scheduler_would():
    # weight_updater.py:339-341 (idle assert), :390 (set.remove -> KeyError), scheduler.py:6370-6373.
    e = engine(token_delay_s=0.005)
    tm = e.tokenizer_manager
    with pytest.raises(sgl.SchedulerCrash, match="KeyError"):
        await tm.resume_memory_occupation(sgl.ResumeMemoryOccupationReqInput(tags=["weights"]), None)
    task = asyncio.ensure_future(gen(e, "busy", max_new_tokens=500))
    await wait_until(lambda: tm.scheduler.running)
    with pytest.raises(sgl.SchedulerCrash, match="idle"):
        await tm.release_memory_occupation(sgl.ReleaseMemoryOccupationReqInput(), None)
    tm.abort_request("busy")
    await task
    await tm.release_memory_occupation(sgl.ReleaseMemoryOccupationReqInput(tags=["kv_cache"]), None)
    assert tm.scheduler.offload_tags == {"kv_cache"}


async def test_unseeded_requests_get_42_under_deterministic_inference_and_seeds_count_only_there():
    # sampling_batch_info.py:157-172.
    det = sgl.Engine(model_path="/m", enable_deterministic_inference=True)
    assert (await gen(det, "a"))["output_ids"] == (await gen(det, "b"))["output_ids"]
    assert (await gen(det, "c", sampling_seed=1))["output_ids"] != (await gen(det, "d", sampling_seed=2))["output_ids"]
    plain = sgl.Engine(model_path="/m")  # without it a seed is ignored
    assert (await gen(plain, "e", sampling_seed=1))["output_ids"] != (await gen(plain, "f", sampling_seed=1))["output_ids"]


async def test_a_rid_is_held_until_the_scheduler_answers_an_abort():
    # tokenizer_manager.py:3850-3874 and :3835-3836: a dispatched request cancelled by its caller
    # is aborted once and its rid stays taken until the abort comes back.
    e = engine(token_delay_s=0.005)
    tm = e.tokenizer_manager
    task = asyncio.ensure_future(gen(e, "held", max_new_tokens=500))
    await wait_until(lambda: tm.scheduler.running)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert tm.aborts_dispatched == ["held"] and "held" in tm.rid_to_state
    with pytest.raises(ValueError, match="Duplicate request ID detected: held"):
        await gen(e, "held")
    await wait_until(lambda: "held" not in tm.rid_to_state)
