"""The SGLang adapter's weight calls against the 0.5.23 stand-in: a trainer's push (the stand-in joins
the group with SGLang's own ``init_custom_process_group``), the begin/end bracket, in-place pause and
the deferred flush, retract, tensors from this host, dp_size refusals, what a failed push leaves."""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch

from redroll.engine_worker.engines.base import EngineCommandRefused, WeightUpdateError
from redroll.engine_worker.engines.sglang_engine import SGLangEngine
from redroll.engine_worker.engines.tiny_model import build_tiny_model
from redroll.engine_worker.engines.transformers_engine import TransformersEngine
from redroll.engine_worker.worker import Worker
from redroll.ops.control import live_workers
from redroll.producer import Producer
from redroll.shared.commands import TensorSpec
from redroll.shared.types import RecordStatus
from redroll.shared.weight_group import WeightGroup, dtype_name
from tests import sglang_standin as sgl
from tests.conftest import running, wait_until
from tests.test_sglang_engine import req, scheduler, started
from tests.test_weight_sync import PROMPT, perturbed


def tiny_shapes() -> dict:
    return {name: tuple(p.shape) for name, p in build_tiny_model(0).named_parameters()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def io_classes(engine: SGLangEngine) -> list[str]:
    return [type(call).__name__ for call in engine.engine.tokenizer_manager.update_calls]


def the_update(engine: SGLangEngine, cls: str):
    (call,) = [c for c in engine.engine.tokenizer_manager.update_calls if type(c).__name__ == cls]
    return call


async def join_by_hand(engine: SGLangEngine, name: str) -> WeightGroup:
    """A trainer's group ``name`` (rank 0, gloo) that the engine joined as rank 1."""
    port = free_port()
    joining = asyncio.create_task(engine.join_weight_group(address="127.0.0.1", port=port, rank_offset=1,
                                                           world_size=2, group_name=name, backend="gloo",
                                                           timeout_s=20))
    group = await asyncio.to_thread(WeightGroup.open, address="127.0.0.1", port=port, rank=0, world_size=2,
                                    name=name, timeout_s=20)
    await joining
    return group


async def push_by_hand(engine: SGLangEngine, tensors: dict, version: str, *, in_place: bool = True):
    """Rank 0 (a trainer) and the engine (rank 1) in one group; returns once the engine took it."""
    name = f"g-{free_port()}"
    group = await join_by_hand(engine, name)
    specs = [TensorSpec(name=n, dtype=dtype_name(t.dtype), shape=list(t.shape)) for n, t in tensors.items()]
    receiving = asyncio.create_task(engine.receive_weights(specs, group_name=name, version=version, in_place=in_place))

    def broadcast():
        for t in tensors.values():
            group.broadcast(t.contiguous(), 0)

    await asyncio.to_thread(broadcast)
    try:
        await receiving
    finally:
        await engine.leave_weight_group()
        group.close()


async def test_a_push_goes_through_the_begin_end_bracket_and_reaches_the_model():
    engine = await started({"param_shapes": tiny_shapes()})
    model = perturbed(build_tiny_model(0), 5)
    tensors = {n: p.detach().clone() for n, p in model.named_parameters()}
    await push_by_hand(engine, tensors, "1", in_place=False)
    weights = scheduler(engine).weights
    assert set(weights) == set(tensors) and all(torch.equal(weights[n], t) for n, t in tensors.items())
    assert io_classes(engine) == ["InitWeightsUpdateGroupReqInput", "BeginWeightUpdateReqInput",
                                  "UpdateWeightsFromDistributedReqInput", "EndWeightUpdateReqInput",
                                  "DestroyWeightsUpdateGroupReqInput"]
    update = the_update(engine, "UpdateWeightsFromDistributedReqInput")
    assert update.weight_version == "1" and update.flush_cache is True  # (nothing ran: a flush is free)
    assert engine.info.weight_version == "1" and scheduler(engine).weight_version == "1"
    assert scheduler(engine).groups == {} and scheduler(engine).session is None
    out = await engine.generate(req("after"), "h1")
    assert out.weight_version == "1"
    await engine.close()


async def test_an_in_place_push_pauses_swaps_and_flushes_once_no_request_spans_it():
    engine = await started({"param_shapes": tiny_shapes(), "token_delay_s": 0.004})
    running_jobs = [asyncio.create_task(engine.generate(req(f"r{i}", max_new_tokens=150, ignore_eos=True),
                                                        f"h{i}")) for i in range(3)]
    await wait_until(lambda: len(scheduler(engine).running) == 3 and
                     all(len(r.output_ids) > 10 for r in scheduler(engine).running))
    model = perturbed(build_tiny_model(0), 6)
    await push_by_hand(engine, {n: p.detach().clone() for n, p in model.named_parameters()}, "1")
    assert scheduler(engine).pauses == ["in_place"]
    assert the_update(engine, "UpdateWeightsFromDistributedReqInput").flush_cache is False
    # A request that arrives now waits until the ones that span the swap finished and the prefix
    # cache (computed with the old weights) is flushed.
    calls_before = len(engine.engine.calls)
    late = asyncio.create_task(engine.generate(req("late", max_new_tokens=4), "late"))
    await asyncio.sleep(0.1)
    assert len(engine.engine.calls) == calls_before and scheduler(engine).flushes == 0
    outs = await asyncio.gather(*running_jobs)
    late_out = await asyncio.wait_for(late, 10)
    assert scheduler(engine).flushes == 1 and engine.cache_flushes == 1
    for out in outs:
        (sample,) = out.samples
        assert sample.finish_reason == "length" and len(sample.token_ids) == 150  # nothing aborted
        versions = sample.weight_versions
        switch = versions.index("1")
        assert 10 < switch and set(versions[:switch]) == {"default"} and set(versions[switch:]) == {"1"}
        assert out.weight_version == "1"
    assert late_out.samples[0].weight_versions is None and late_out.weight_version == "1"
    assert engine.engine.tokenizer_manager.aborts_dispatched == []
    await engine.close()


async def test_retract_mode_recomputes_the_running_requests_and_flushes_with_the_update():
    engine = await started({"token_delay_s": 0.004}, pause_mode="retract")
    jobs = [asyncio.create_task(engine.generate(req(f"r{i}", max_new_tokens=80, ignore_eos=True), f"h{i}"))
            for i in range(2)]
    await wait_until(lambda: len(scheduler(engine).running) == 2 and
                     all(len(r.output_ids) > 5 for r in scheduler(engine).running))
    await engine.update_weights_from_tensor([("w", torch.ones(3))], "2")
    update = the_update(engine, "UpdateWeightsFromTensorReqInput")
    assert update.flush_cache is True and update.weight_version == "2"
    assert scheduler(engine).pauses == ["retract"] and scheduler(engine).flushes == 1
    assert engine._dispatch_open.is_set()  # (no flush left to wait for)
    outs = await asyncio.gather(*jobs)
    assert all(o.samples[0].finish_reason == "length" and len(o.samples[0].token_ids) == 80 for o in outs)
    assert all("2" in o.samples[0].weight_versions for o in outs)
    assert torch.equal(scheduler(engine).weights["w"], torch.ones(3))
    await engine.close()


async def test_tensors_from_this_host_are_serialized_per_tensor_parallel_rank():
    engine = await started(tp_size=2)
    assert engine.info.weight_ranks == 2
    await engine.update_weights_from_tensor([("a", torch.arange(4.0)), ("b", torch.zeros(2, 2))], "3",
                                            in_place=False)
    update = the_update(engine, "UpdateWeightsFromTensorReqInput")
    assert len(update.serialized_named_tensors) == 2  # one payload per rank (entrypoints/engine.py:1743-1760)
    assert all(isinstance(p, bytes) for p in update.serialized_named_tensors)
    assert io_classes(engine) == ["BeginWeightUpdateReqInput", "UpdateWeightsFromTensorReqInput",
                                  "EndWeightUpdateReqInput"]
    assert torch.equal(scheduler(engine).weights["a"], torch.arange(4.0)) and engine.info.weight_version == "3"
    await engine.close()


async def test_an_in_place_update_from_disk_pauses_instead_of_waiting_for_requests():
    engine = await started({"token_delay_s": 0.004})
    job = asyncio.create_task(engine.generate(req("r", max_new_tokens=100, ignore_eos=True), "h"))
    await wait_until(lambda: scheduler(engine).running and len(scheduler(engine).running[0].output_ids) > 5)
    await asyncio.wait_for(engine.update_weights_from_disk("/ckpt/4", "4", in_place=True), 1.0)
    assert job.done() is False  # (without a pause it would have waited for the request)
    assert the_update(engine, "UpdateWeightFromDiskReqInput").flush_cache is False
    out = await job
    versions = out.samples[0].weight_versions
    assert versions[0] == "default" and versions[-1] == "4" and len(versions) == 100
    await engine.close()


async def test_weight_sync_on_data_parallel_replicas_is_refused_before_sglang_asserts():
    engine = await started(dp_size=2)
    with pytest.raises(EngineCommandRefused, match="dp_size 1"):
        await engine.join_weight_group(address="127.0.0.1", port=free_port(), rank_offset=1, world_size=2,
                                       group_name="g", backend="gloo", timeout_s=5)
    with pytest.raises(EngineCommandRefused, match="dp_size"):
        await engine.update_weights_from_tensor([("a", torch.zeros(1))], "1")
    with pytest.raises(AssertionError, match="data-parallel"):  # what SGLang itself would do
        await engine.engine.tokenizer_manager.update_weights_from_tensor(
            sgl.io_struct.UpdateWeightsFromTensorReqInput(serialized_named_tensors=[]), None)
    await engine.close()


async def test_what_a_failed_push_leaves_behind():
    # Refused after the receive (the tensors do not fit): SGLang may hold a mix, so the worker
    # must not serve until the next push.
    engine = await started({"param_shapes": {"x": (2,)}})
    with pytest.raises(WeightUpdateError, match="does not fit"):
        await push_by_hand(engine, {"x": torch.zeros(3)}, "1", in_place=False)
    assert await engine.discard_weights() is False
    # The trainer gone mid-broadcast: nothing was loaded, the old weights serve on.
    name = "g-gone"
    group = await join_by_hand(engine, name)
    receiving = asyncio.create_task(engine.receive_weights(
        [TensorSpec(name="x", dtype="float32", shape=[2])], group_name=name, version="2", in_place=False))
    await asyncio.sleep(0.2)
    group.close()
    with pytest.raises(WeightUpdateError, match="Failed to receive weights"):
        await asyncio.wait_for(receiving, 20)
    assert await engine.discard_weights() is True and engine.info.weight_version == "default"
    await engine.leave_weight_group()
    await engine.close()


async def test_one_push_reaches_an_sglang_worker_and_a_transformers_worker(settings, r):
    # The trainer's group and SGLang's (init_custom_process_group) agree on every store key: a
    # fleet of both engines takes one push, in place, under load.
    sglang_engine = SGLangEngine("/models/tiny", engine_factory=sgl.Engine.with_options(
        param_shapes=tiny_shapes(), token_delay_s=0.004))
    workers = [Worker(settings, sglang_engine, max_inflight=4, block_ms=100),
               Worker(settings, TransformersEngine("tiny-random", max_batch_size=8), max_inflight=4, block_ms=100)]
    async with running(*workers):
        await asyncio.gather(*(w.started.wait() for w in workers))
        await wait_until(lambda: _live(r, settings, 2))
        model = build_tiny_model(0)
        async with Producer(settings) as p, p.weight_sync(timeout_s=20, mode="in_place") as sync:
            futures = await p.submit_many([dict(input_ids=PROMPT, sampling_params={
                "max_new_tokens": 120, "ignore_eos": True}) for _ in range(6)])
            await wait_until(lambda: sum(w.generating_count for w in workers) >= 4)
            report = await asyncio.wait_for(sync.push(perturbed(model, 9).named_parameters(), version="1"), 60)
            records = await asyncio.wait_for(asyncio.gather(*futures), 60)
        assert sorted(report.workers) == sorted(w.name for w in workers)
        beats = await live_workers(r, settings.keys)
        assert {b["weight_version"] for b in beats.values()} == {"1"}
        received = scheduler(sglang_engine).weights
        assert all(torch.equal(received[n], p.detach()) for n, p in model.named_parameters())
    assert all(rec.status is RecordStatus.FINISHED for rec in records)
    assert sum(w.stats.by_status.get("aborted", 0) for w in workers) == 0


async def _live(r, settings, n: int) -> bool:
    return len(await live_workers(r, settings.keys)) == n
