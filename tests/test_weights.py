"""Weight updates through the control stream: a single switch point per worker, late joiners,
abort of in-flight work, released memory."""

from __future__ import annotations

import asyncio
import json

import pytest

from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.ops.control import live_workers, send_command
from redroll.producer import Producer
from redroll.shared.commands import ReleaseMemory, ResumeMemory
from redroll.shared.types import RecordStatus
from tests.conftest import wait_until


async def _start(settings, **engine_kw):
    worker = Worker(settings, SyntheticEngine(**engine_kw), max_inflight=8, block_ms=200)
    task = asyncio.create_task(worker.run())
    return worker, task


async def _stop(*pairs):
    for worker, _ in pairs:
        worker.request_stop()
    await asyncio.gather(*(t for _, t in pairs))


async def test_update_during_traffic_switches_once_per_worker(settings, r):
    pairs = [await _start(settings, token_ms=3) for _ in range(2)]
    await wait_until(lambda: _n_live(r, settings, 2))
    arrived = []
    async with Producer(settings) as p:
        futs = await p.submit_many([dict(request_id=f"w-{i}", prompt=str(i), sampling_params={"max_new_tokens": 5})
                                    for i in range(120)], callback=arrived.append)
        await wait_until(lambda: len(arrived) >= 20)
        workers = await p.update_weights("/ckpt/step-2", "2", timeout=30)
        assert {b["weight_version"] for b in workers.values()} == {"2"} and len(workers) == 2
        more = await p.submit_many([dict(request_id=f"x-{i}", prompt=str(i), sampling_params={"max_new_tokens": 5})
                                    for i in range(40)], callback=arrived.append)
        records = await asyncio.wait_for(asyncio.gather(*futs, *more), 30)
    await _stop(*pairs)
    assert all(rec.status is RecordStatus.FINISHED for rec in records)
    assert len(arrived) == 160 == len({rec.request_id for rec in arrived})  # none lost, none twice
    for worker, _ in pairs:
        versions = [rec.meta_info["weight_version"] for rec in arrived if rec.worker == worker.name]
        switch = versions.index("2") if "2" in versions else len(versions)
        assert set(versions[:switch]) <= {"0"} and set(versions[switch:]) <= {"2"}, versions
    assert all(rec.meta_info["weight_version"] == "2" for rec in arrived if rec.request_id.startswith("x-"))
    assert "0" in {rec.meta_info["weight_version"] for rec in arrived}


async def _n_live(r, settings, n):
    return len(await live_workers(r, settings.keys)) == n


async def test_late_joiner_loads_desired_weights_before_claiming(settings, r):
    first = await _start(settings)
    async with Producer(settings) as p:
        await p.update_weights("/ckpt/step-5", "5", timeout=30)
        first[0].request_stop()
        await first[1]
        fut = await p.submit(prompt="after", sampling_params={"max_new_tokens": 3})
        late = await _start(settings)  # starts at version "0", must load "5" first
        rec = await asyncio.wait_for(fut, 10)
    await _stop(late)
    assert rec.meta_info["weight_version"] == "5" and rec.worker == late[0].name


async def test_update_with_abort_inflight_returns_partial_output(settings, r):
    pair = await _start(settings, token_ms=20)
    async with Producer(settings) as p:
        fut = await p.submit(prompt="long", collect_unfinished=True, return_logprob=True,
                             sampling_params={"max_new_tokens": 500})
        await wait_until(lambda: pair[0].inflight_count == 1)
        await asyncio.sleep(0.2)
        await p.update_weights("/ckpt/step-3", "3", abort_inflight=True, timeout=10)
        rec = await asyncio.wait_for(fut, 5)
        after = await asyncio.wait_for(await p.submit(prompt="next", sampling_params={"max_new_tokens": 2}), 10)
    await _stop(pair)
    assert rec.status is RecordStatus.ABORTED and rec.finish_reasons == ["abort"]
    assert 0 < len(rec.output_token_ids[0]) < 500 and rec.meta_info["weight_version"] == "0"
    assert after.meta_info["weight_version"] == "3"


async def test_release_and_resume_memory_pause_claiming(settings, r):
    pair = await _start(settings)
    await wait_until(lambda: _n_live(r, settings, 1))
    await send_command(r, settings.keys, ReleaseMemory())
    await wait_until(lambda: _state_is(r, settings, pair[0].name, "released"))
    async with Producer(settings) as p:
        fut = await p.submit(prompt="waits", sampling_params={"max_new_tokens": 2})
        await asyncio.sleep(0.5)
        assert not fut.done()  # nothing is claimed while memory is released
        await send_command(r, settings.keys, ResumeMemory())
        rec = await asyncio.wait_for(fut, 10)
    await _stop(pair)
    assert rec.status is RecordStatus.FINISHED


async def _state_is(r, settings, name, state):
    raw = await r.hget(settings.keys.workers, name)
    return raw is not None and json.loads(raw)["state"] == state


async def test_transformers_weight_update_changes_outputs():
    pytest.importorskip("torch")
    from redroll.engine_worker.engines.transformers_engine import TransformersEngine
    from redroll.producer.client import make_request

    engine = TransformersEngine("tiny-random")
    await engine.start()
    req = make_request(input_ids=[65, 66, 67], sampling_params={"max_new_tokens": 8, "temperature": 0})
    before = await engine.generate(req, "a")
    await engine.update_weights_from_disk("tiny-random:1", "1")
    after = await engine.generate(make_request(request_id=req.request_id, input_ids=[65, 66, 67],
                                               sampling_params={"max_new_tokens": 8, "temperature": 0}), "b")
    await engine.close()
    assert engine.info.weight_version == "1" and after.weight_version == "1"
    assert before.samples[0].token_ids != after.samples[0].token_ids


async def test_sglang_adapter_weight_update_during_traffic(settings, r):
    """The SGLang engine (on the sglang 0.5.x stand-in) behind real workers: a weight update
    through the control stream mid-traffic loses nothing, and each worker's records switch
    version once."""
    import tests.sglang_standin as sgl
    from redroll.engine_worker.engines.sglang_engine import SGLangEngine

    factory = sgl.Engine.with_options(token_delay_s=0.02)
    pairs = []
    for _ in range(2):
        worker = Worker(settings, SGLangEngine("/models/tiny", engine_factory=factory, weight_version="0"),
                        max_inflight=16, block_ms=200)
        pairs.append((worker, asyncio.create_task(worker.run())))
    await wait_until(lambda: _n_live(r, settings, 2))
    arrived = []
    async with Producer(settings) as p:
        futs = await p.submit_many([dict(request_id=f"s-{i}", input_ids=[5, 6, 7], return_logprob=True,
                                         sampling_params={"max_new_tokens": 6, "n": 2}) for i in range(160)],
                                   callback=arrived.append)
        await wait_until(lambda: len(arrived) >= 10)
        await p.update_weights("/ckpt/step-1", "1", timeout=30)
        records = await asyncio.wait_for(asyncio.gather(*futs), 60)
    await _stop(*pairs)
    assert all(rec.status is RecordStatus.FINISHED for rec in records) and len(arrived) == 160
    assert all(len(ids) == len(lp) for rec in records for ids, lp in zip(rec.output_token_ids, rec.output_logprobs))
    for worker, _ in pairs:
        versions = [rec.meta_info["weight_version"] for rec in arrived if rec.worker == worker.name]
        switch = versions.index("1") if "1" in versions else len(versions)
        assert set(versions[:switch]) <= {"0"} and set(versions[switch:]) <= {"1"}, versions
    assert {rec.meta_info["weight_version"] for rec in arrived} == {"0", "1"}


async def test_an_in_place_update_from_disk_leaves_requests_running_and_tags_their_tokens(settings, r):
    # The synthetic engine swaps between two tokens: nothing waits, nothing is aborted, and each
    # record that spans the update says which version made which token.
    pairs = [await _start(settings, token_ms=5)]
    await wait_until(lambda: _n_live(r, settings, 1))
    async with Producer(settings) as p:
        futs = await p.submit_many([dict(request_id=f"ip-{i}", prompt=str(i), sampling_params={
            "max_new_tokens": 80, "ignore_eos": True}) for i in range(4)])
        await wait_until(lambda: pairs[0][0].generating_count == 4)
        await asyncio.sleep(0.1)
        await asyncio.wait_for(p.update_weights("/ckpt/ip", "5", mode="in_place", timeout=30), 5)
        records = await asyncio.wait_for(asyncio.gather(*futs), 30)
    await _stop(*pairs)
    assert all(rec.status is RecordStatus.FINISHED and len(rec.output_token_ids[0]) == 80 for rec in records)
    for rec in records:
        versions = rec.token_versions(0)
        switch = versions.index("5")
        assert 0 < switch < 80 and set(versions[switch:]) == {"5"} and "5" not in versions[:switch]
