"""A trainer pushes weights over torch.distributed (gloo, CPU) to real worker processes.

The workers and the trainer build the same tiny model (seed 0); a push changes the trainer's copy
and the records' logprobs must then match the trainer's teacher-forced recomputation, which shows
the tensors arrived, not only the version label.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch  # noqa: E402  (CI installs it: .ci/run)

from redroll.engine_worker.engines.tiny_model import build_tiny_model, teacher_forced_logprobs
from redroll.engine_worker.engines.transformers_engine import TransformersEngine
from redroll.engine_worker.worker import Worker
from redroll.ops.control import live_workers
from redroll.producer import Producer
from redroll.shared.types import RecordStatus
from tests.conftest import running, spawn, stop_process, wait_until

PROMPT = [10, 20, 30, 40]


def perturbed(model, seed: int):
    """A training step, as far as the weights go: every parameter moved a little."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def assert_same_weights(record, model) -> None:
    want = teacher_forced_logprobs(model, PROMPT, record.output_token_ids[0], 1.0)
    got = record.output_logprobs[0]
    assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) < 1e-4


async def _live(r, settings, n: int) -> bool:
    return len(await live_workers(r, settings.keys)) == n


def worker_process(settings, log):
    return spawn(settings, "worker", "--engine", "transformers", "--model-path", "tiny-random", "--max-inflight", "8",
                 "--max-batch-size", "16", log=log)


@pytest.mark.slow
async def test_three_pushes_reach_every_worker_process_and_tag_their_records(settings, r, tmp_path):
    procs = [worker_process(settings, tmp_path / f"w{i}.log") for i in range(2)]
    try:
        await wait_until(lambda: _live(r, settings, 2), timeout=60)
        model = build_tiny_model(0)
        async with Producer(settings) as p, p.weight_sync(timeout_s=30) as sync:
            for version in ("1", "2", "3"):
                perturbed(model, int(version))
                report = await asyncio.wait_for(sync.push(model.named_parameters(), version=version), 60)
                assert len(report.workers) == 2 and report.attempts == 1 and report.tensors == 21
                beats = await live_workers(r, settings.keys)
                assert {b["weight_version"] for b in beats.values()} == {version}
                assert {b["weights_source"] for b in beats.values()} == {f"push:{version}"}
                futures = await p.submit_many([dict(input_ids=PROMPT, return_logprob=True,
                                                    sampling_params={"max_new_tokens": 12, "temperature": 1.0})
                                               for _ in range(6)])
                for rec in await asyncio.wait_for(asyncio.gather(*futures), 30):
                    assert rec.status is RecordStatus.FINISHED and rec.meta_info["weight_version"] == version
                    assert rec.weight_versions is None  # (no push while it ran)
                    assert_same_weights(rec, model)
            assert p.weight_version == 3
        assert (await r.hgetall(settings.keys.weights))[b"weight_version"] == b"3"
    finally:
        for proc in procs:
            stop_process(proc)


@pytest.mark.slow
async def test_a_worker_killed_during_a_push_neither_hangs_the_trainer_nor_loses_a_request(settings, r, tmp_path):
    procs = [worker_process(settings, tmp_path / f"w{i}.log") for i in range(2)]
    try:
        await wait_until(lambda: _live(r, settings, 2), timeout=60)
        beats = await live_workers(r, settings.keys)
        victim = next(n for n, b in beats.items() if b["pid"] == procs[0].pid)
        model = build_tiny_model(0)
        async with Producer(settings) as p, p.weight_sync(timeout_s=10) as sync:
            futures = await p.submit_many([dict(request_id=f"long-{i}", input_ids=PROMPT, return_logprob=True,
                                                sampling_params={"max_new_tokens": 400, "ignore_eos": True})
                                           for i in range(8)])
            await wait_until(lambda: _pending(r, settings, 8), timeout=30)
            push = asyncio.create_task(sync.push(perturbed(model, 7).named_parameters(), version="7"))
            # SIGKILL the victim as soon as it has joined the group: the broadcast is under way.
            await wait_until(lambda: _status(r, settings, victim, "joined"), timeout=30, interval=0.002)
            os.kill(procs[0].pid, signal.SIGKILL)
            killed_at = time.monotonic()
            report = await asyncio.wait_for(push, 60)
            push_s = time.monotonic() - killed_at
            records = await asyncio.wait_for(asyncio.gather(*futures), 60)
        assert victim not in report.workers and len(report.workers) == 1
        print("push after the kill:", report, f"{push_s:.2f}s")
        assert report.attempts >= 1 and push_s < 30
        assert sorted(rec.request_id for rec in records) == [f"long-{i}" for i in range(8)]  # none lost
        assert all(rec.status is RecordStatus.FINISHED for rec in records)
        survivor_beat = next(b for n, b in (await live_workers(r, settings.keys)).items() if n != victim)
        assert survivor_beat["weight_version"] == "7"
        assert await r.xlen(settings.keys.requests) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                stop_process(proc)


async def _pending(r, settings, n: int) -> bool:
    try:
        return int((await r.xpending(settings.keys.requests, "workers"))["pending"]) == n
    except Exception:
        return False


async def _status(r, settings, worker: str, want: str) -> bool:
    for key in await r.keys(settings.keys.weight_sync("*")):
        for field, value in (await r.hgetall(key)).items():
            if field.decode().startswith(worker + ":") and value.decode() == want:
                return True
    return False


async def test_an_in_place_push_under_load_aborts_nothing_and_tags_every_token(settings, r):
    # Requests running while the weights change: none is aborted; each record's tokens carry the
    # version that made them, old then new, in order.
    workers = [Worker(settings, TransformersEngine("tiny-random", max_batch_size=16), max_inflight=8, block_ms=100)
               for _ in range(2)]
    async with running(*workers):
        await asyncio.gather(*(w.started.wait() for w in workers))
        await wait_until(lambda: _live(r, settings, 2))
        model = build_tiny_model(0)
        async with Producer(settings) as p, p.weight_sync(timeout_s=20, mode="in_place") as sync:
            futures = await p.submit_many([dict(input_ids=PROMPT, return_logprob=True, sampling_params={
                "max_new_tokens": 300, "ignore_eos": True}) for _ in range(12)])
            await wait_until(lambda: sum(w.generating_count for w in workers) >= 8)
            await asyncio.sleep(0.2)
            await sync.push(perturbed(model, 3).named_parameters(), version="1")
            records = await asyncio.wait_for(asyncio.gather(*futures), 60)
    assert [rec.status for rec in records] == [RecordStatus.FINISHED] * 12
    assert sum(w.stats.by_status.get("aborted", 0) for w in workers) == 0
    spanning = [rec for rec in records if rec.weight_versions]
    assert spanning, "some requests ran across the push"
    for rec in spanning:
        versions = rec.weight_versions[0]
        assert len(versions) == len(rec.output_token_ids[0]) == 300
        switch = versions.index("1")
        assert 0 < switch and set(versions[:switch]) == {"0"} and set(versions[switch:]) == {"1"}
        assert rec.meta_info["weight_version"] == "1"


async def test_a_late_joiner_waits_for_the_next_push_and_says_so(settings, r):
    first = Worker(settings, TransformersEngine("tiny-random"), max_inflight=4, block_ms=100)
    model = build_tiny_model(0)
    async with running(first):
        await first.started.wait()
        await wait_until(lambda: _live(r, settings, 1))
        async with Producer(settings) as p, p.weight_sync(timeout_s=20) as sync:
            await sync.push(perturbed(model, 1).named_parameters(), version="1")
            late = Worker(settings, TransformersEngine("tiny-random"), max_inflight=4, block_ms=100)
            async with running(late):
                await late.started.wait()
                await wait_until(lambda: _live(r, settings, 2))
                beat = (await live_workers(r, settings.keys))[late.name]
                assert beat["state"] == "awaiting_weights" and beat["weights_source"] == "awaiting push"
                await sync.push(perturbed(model, 2).named_parameters(), version="2")
                beat = (await live_workers(r, settings.keys))[late.name]
                assert beat["weight_version"] == "2" and late.state() == "running"
                rec = await asyncio.wait_for(await p.submit(input_ids=PROMPT, return_logprob=True,
                                                            sampling_params={"max_new_tokens": 8}), 20)
                assert rec.meta_info["weight_version"] == "2"
                assert_same_weights(rec, model)


class _CommitFailsOnce(TransformersEngine):
    commits_failed = 0

    async def commit_weights(self, version: str) -> None:
        if not self.commits_failed:
            self.commits_failed += 1
            raise RuntimeError("the engine could not swap its weights in")
        await super().commit_weights(version)


async def test_a_commit_that_fails_on_a_worker_is_reported_at_once_and_the_push_repeated(settings, r):
    # (the worker once said nothing: the trainer waited for "committed" until its timeout)
    engine = _CommitFailsOnce("tiny-random")
    worker = Worker(settings, engine, max_inflight=4, block_ms=100)
    model = build_tiny_model(0)
    async with running(worker):
        await worker.started.wait()
        await wait_until(lambda: _live(r, settings, 1))
        async with Producer(settings) as p, p.weight_sync(timeout_s=60) as sync:
            started = time.monotonic()
            report = await sync.push(perturbed(model, 1).named_parameters(), version="1")
            took = time.monotonic() - started
            assert engine.commits_failed == 1 and report.attempts == 2 and took < 30  # (not the 60 s timeout)
            rec = await asyncio.wait_for(await p.submit(input_ids=PROMPT, return_logprob=True,
                                                        sampling_params={"max_new_tokens": 8}), 20)
    assert rec.meta_info["weight_version"] == "1"
    assert_same_weights(rec, model)


def listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) listening on ``port``."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:
                    out.append(address)
    return out


def test_the_trainer_serves_the_rendezvous_on_its_own_address_only():
    from redroll.producer.weight_sync import free_port
    from redroll.shared.weight_group import WeightGroup

    port = free_port("127.0.0.1")
    group = WeightGroup.open(address="127.0.0.1", port=port, rank=0, world_size=1, name="alone", timeout_s=5)
    try:
        assert listening_addresses(port) == ["0100007F"]  # 127.0.0.1, not every interface
        group.broadcast(torch.arange(3.0), 0)  # (a group of one: nothing to wait for)
    finally:
        group.close()
    # An unpatched TCPStore, for comparison, listens on every interface.
    store = torch.distributed.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)
    try:
        assert "0100007F" not in listening_addresses(port) and listening_addresses(port)
    finally:
        del store
