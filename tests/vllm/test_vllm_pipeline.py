"""``redroll worker --engine vllm`` through Redis: real processes, the real vLLM (CPU).

One worker process serves the module's requests (the CLI and the Python API, an abort, a weight
reload) until a SIGKILL hands its resumable request to a survivor; a second worker drains on
SIGTERM. After each exit, none of the worker's vLLM processes is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid

import pytest
import pytest_asyncio

from redroll.engine_worker.engines.child_guard import descendants
from redroll.engine_worker.engines.tiny_checkpoint import load_tiny_checkpoint
from redroll.engine_worker.engines.tiny_model import teacher_forced_logprobs
from redroll.engine_worker.engines.vllm_engine import VLLMEngine
from redroll.engine_worker.worker import Worker
from redroll.producer import Producer
from redroll.producer.client import make_request
from redroll.shared.checkpoint_reads import load_checkpoint
from redroll.shared.connection import connect
from redroll.shared.keys import WORKERS_GROUP
from redroll.shared.settings import Settings
from redroll.shared.types import RecordStatus
from tests.conftest import ROOT, redroll_env, running, spawn, stop_process, wait_until
from tests.vllm.conftest import engine_options

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

PROMPT = [60, 61, 62, 63, 64, 65, 66, 67]
CHECKPOINTS = {"REDROLL_CHECKPOINT_TOKENS": "32", "REDROLL_CHECKPOINT_INTERVAL_S": "0.05",
               "REDROLL_CHECKPOINT_MIN_NEW_TOKENS": "64"}


def worker_args(model) -> list[str]:
    # (no --max-inflight: the worker holds what its engine batches)
    return ["worker", "--engine", "vllm", "--model-path", str(model), "--dtype", "float32",
            "--context-length", "2048"]


@pytest.fixture(scope="module")
def settings(redis_server):
    return Settings(redis_url=redis_server.url, namespace="v" + uuid.uuid4().hex[:10], claim_idle_ms=1500,
                    heartbeat_s=0.5, drain_timeout_s=20.0, max_deliveries=3).with_(
        checkpoint_tokens=32, checkpoint_interval_s=0.05, checkpoint_min_new_tokens=64)


@pytest.fixture(scope="module")
def first_worker(settings, tiny_checkpoints, tmp_path_factory):
    log = tmp_path_factory.mktemp("w1") / "worker.log"
    proc = spawn(settings, *worker_args(tiny_checkpoints[0]), "--name", "first", log=log, **CHECKPOINTS)
    yield proc
    if proc.poll() is None:
        stop_process(proc, 60)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def producer(settings):
    async with Producer(settings) as p:
        yield p


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    return [load_tiny_checkpoint(path) for path in tiny_checkpoints]


def max_error(values, ref) -> float:
    return max(abs(a - b) for a, b in zip(values, ref))


async def test_a_worker_started_without_max_inflight_holds_its_engines_batch(settings, first_worker, producer):
    """The worker was capped at --max-inflight's old default, 32, where vLLM batches far more: its
    capacity (vLLM's resolved max_num_seqs) plus the claim prefetch is what it holds now, as
    `redroll status --json` shows."""
    await asyncio.wait_for(producer.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2}), 300)
    status = subprocess.run([sys.executable, "-m", "redroll.cli", "status", "--json"], cwd=ROOT,
                            env=redroll_env(settings), capture_output=True, text=True, timeout=60)
    (worker,) = [w for w in json.loads(status.stdout)["workers"] if w["name"] == "first"]
    assert worker["engine"] == "vllm" and worker["capacity"] > 32, worker
    assert worker["max_inflight"] == worker["claim_limit"] == worker["capacity"] + settings.claim_prefetch


async def test_redroll_submit_serves_token_id_and_text_prompts(settings, first_worker, tmp_path, tiny_checkpoints):
    lines = [{"request_id": "cli-ids", "input_ids": PROMPT, "return_logprob": True,
              "sampling_params": {"max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 1}},
             {"request_id": "cli-text", "prompt": "Hello, world!", "sampling_params": {"max_new_tokens": 8, "n": 2}}]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(x) + "\n" for x in lines))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "redroll.cli", "submit", "--wait", str(source), "--out", str(out), "--no-progress",
        "--timeout", "170", cwd=ROOT, env=redroll_env(settings))
    assert await proc.wait() == 0
    records = {r["request_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    ids = records["cli-ids"]
    assert ids["status"] == "finished" and len(ids["output_token_ids"][0]) == len(ids["output_logprobs"][0]) == 16
    meta = ids["meta_info"]
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 16 and meta["weight_version"] == "0"
    assert meta["eos_token_id"] == 1 and meta["pad_token_id"] == 2 and meta["cached_tokens"] >= 0
    assert meta["logprob_mode"].startswith("processed")
    text = records["cli-text"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_checkpoints[0]))
    assert text["meta_info"]["prompt_tokens"] == len(tokenizer.encode("Hello, world!"))
    assert [len(x) for x in text["output_token_ids"]] == [8, 8] or "stop" in text["finish_reasons"]


async def test_the_python_api_gets_seeded_samples_with_teacher_forced_logprobs(producer, first_worker, reference):
    params = {"max_new_tokens": 32, "ignore_eos": True, "n": 4, "sampling_seed": 11}
    a = await asyncio.wait_for(await producer.submit(make_request(request_id="api-a", input_ids=PROMPT,
                                                                  return_logprob=True, sampling_params=params)), 170)
    b = await asyncio.wait_for(await producer.submit(make_request(request_id="api-b", input_ids=PROMPT,
                                                                  return_logprob=True, sampling_params=params)), 60)
    assert a.ok and a.output_token_ids == b.output_token_ids and len({tuple(x) for x in a.output_token_ids}) == 4
    for ids, lps in zip(a.output_token_ids, a.output_logprobs):
        assert max_error(lps, teacher_forced_logprobs(reference[0], PROMPT, ids, 1.0)) < 1e-3


async def test_an_abort_publishes_the_partial_output(producer, first_worker, settings):
    request = make_request(request_id="api-abort", input_ids=PROMPT, collect_unfinished=True,
                           sampling_params={"max_new_tokens": 1500, "ignore_eos": True})
    future = await producer.submit(request)
    async with connect(settings) as r:
        await wait_until(lambda: _pending(r, settings), 120)
    await asyncio.sleep(0.5)
    await producer.abort(["api-abort"])
    record = await asyncio.wait_for(future, 60)
    assert record.status is RecordStatus.ABORTED and record.finish_reasons == ["abort"]
    assert 0 < len(record.output_token_ids[0]) < 1500


async def test_a_deadline_mid_generation_expires_the_request_with_its_partial_output(producer, first_worker):
    import time

    request = make_request(request_id="api-deadline", input_ids=PROMPT, collect_unfinished=True,
                           deadline=time.time() + 2.0, sampling_params={"max_new_tokens": 2000, "ignore_eos": True})
    record = await asyncio.wait_for(await producer.submit(request), 60)
    assert record.status is RecordStatus.EXPIRED and record.finish_reasons == ["abort"]
    assert 0 < len(record.output_token_ids[0]) < 2000


async def test_a_weight_reload_from_disk_gives_the_new_weights_logprobs(settings, producer, first_worker,
                                                                          tiny_checkpoints, reference):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "redroll.cli", "weights", "update", "--model-path", str(tiny_checkpoints[1]),
        "--version", "1", "--timeout", "120", cwd=ROOT, env=redroll_env(settings))
    assert await proc.wait() == 0
    record = await asyncio.wait_for(await producer.submit(make_request(
        request_id="after-reload", input_ids=PROMPT, return_logprob=True,
        sampling_params={"max_new_tokens": 24, "ignore_eos": True, "sampling_seed": 3})), 60)
    ids, lps = record.output_token_ids[0], record.output_logprobs[0]
    assert record.meta_info["weight_version"] == "1"
    assert max_error(lps, teacher_forced_logprobs(reference[1], PROMPT, ids, 1.0)) < 1e-3
    assert max_error(lps, teacher_forced_logprobs(reference[0], PROMPT, ids, 1.0)) > 0.1


async def test_a_sigkilled_worker_leaves_no_engine_and_its_resumable_request_resumes_elsewhere(
        settings, producer, first_worker, tiny_checkpoints, reference):
    budget = 1200
    request = make_request(request_id="resume-1", input_ids=PROMPT, resumable=True, return_logprob=True,
                           sampling_params={"max_new_tokens": budget, "ignore_eos": True, "temperature": 1.0})
    future = await producer.submit(request)
    async with connect(settings) as r:
        async def saved():
            return await load_checkpoint(r, settings.keys, "resume-1")

        async def enough() -> bool:
            cp = await saved()
            return cp is not None and cp.tokens >= 200
        await wait_until(enough, 120, 0.01)
        engine_pids = descendants(first_worker.pid)
        assert len(engine_pids) >= 3  # the guard, vLLM's engine core and its model worker
        os.kill(first_worker.pid, signal.SIGKILL)
        first_worker.wait()
        cp = await saved()
        await wait_until(lambda: not any(_alive(p) for p in engine_pids), 30)
        survivor = Worker(settings, VLLMEngine(str(tiny_checkpoints[0]), **engine_options(max_model_len=2048)),
                          max_inflight=4, block_ms=100, name="survivor")
        async with running(survivor):
            record = await asyncio.wait_for(future, 170)
    ids, lps = record.output_token_ids[0], record.output_logprobs[0]
    assert record.status is RecordStatus.FINISHED and len(ids) == len(lps) == budget
    assert ids[:cp.tokens] == cp.token_ids and lps[:cp.tokens] == cp.logprobs  # the saved prefix, intact
    segments = record.meta_info["segments"]
    assert segments[0]["worker"] == "first" and segments[-1]["worker"] == "survivor"
    assert record.meta_info["resumed_from"] == cp.tokens and segments[-1]["tokens"] == budget - cp.tokens
    assert survivor.engine.tokens_decoded == budget - cp.tokens  # only the rest was decoded
    # the survivor loaded the fleet's weights (version 1, from the reload) before claiming
    assert max_error(lps[cp.tokens:], teacher_forced_logprobs(reference[1], PROMPT + ids[:cp.tokens],
                                                              ids[cp.tokens:], 1.0)) < 1e-3


@pytest.fixture(scope="module")
def second_worker(settings, tiny_checkpoints, tmp_path_factory):
    """A worker on the fleet's weights (version 1 from the reload), started after the SIGKILL."""
    proc = spawn(settings, *worker_args(tiny_checkpoints[1]), "--name", "drained", "--weight-version", "1",
                 log=tmp_path_factory.mktemp("w2") / "worker.log")
    yield proc
    if proc.poll() is None:
        stop_process(proc, 60)


async def test_a_trainer_push_reaches_vllm_and_a_partial_push_is_refused_untouched(
        settings, producer, second_worker, tiny_checkpoints, reference):
    import torch

    async with connect(settings) as r:
        await wait_until(lambda: _live(r, settings, "drained"), 150)
    model = load_tiny_checkpoint(tiny_checkpoints[1])
    with torch.no_grad():  # a training step, as far as the weights go
        gen = torch.Generator().manual_seed(5)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    async with producer.weight_sync(timeout_s=60) as sync:
        partial = [(n, p) for n, p in model.named_parameters() if "layers.1." not in n]
        with pytest.raises(Exception, match="every tensor of its checkpoint"):
            await asyncio.wait_for(sync.push(partial, version="9"), 120)
        before = await asyncio.wait_for(await producer.submit(make_request(
            request_id="push-before", input_ids=PROMPT, return_logprob=True,
            sampling_params={"max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 4})), 60)
        assert before.meta_info["weight_version"] == "1"  # the refused push changed nothing
        assert max_error(before.output_logprobs[0], teacher_forced_logprobs(
            reference[1], PROMPT, before.output_token_ids[0], 1.0)) < 1e-3
        await asyncio.wait_for(sync.push(model.named_parameters(), version="2"), 120)
    record = await asyncio.wait_for(await producer.submit(make_request(
        request_id="push-after", input_ids=PROMPT, return_logprob=True,
        sampling_params={"max_new_tokens": 24, "ignore_eos": True, "sampling_seed": 4})), 60)
    ids, lps = record.output_token_ids[0], record.output_logprobs[0]
    assert record.meta_info["weight_version"] == "2" and record.meta_info["worker"] == "drained"
    assert max_error(lps, teacher_forced_logprobs(model, PROMPT, ids, 1.0)) < 1e-3
    assert max_error(lps, teacher_forced_logprobs(reference[1], PROMPT, ids, 1.0)) > 0.01


async def test_sigterm_drains_the_requests_in_flight_and_leaves_no_engine(settings, producer, second_worker):
    proc = second_worker
    try:
        futures = [await producer.submit(make_request(request_id=f"drain-{i}", input_ids=PROMPT,
                                                      sampling_params={"max_new_tokens": 400, "ignore_eos": True}))
                   for i in range(6)]
        async with connect(settings) as r:
            await wait_until(lambda: _pending(r, settings, 6), 150)
        engine_pids = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 60) == 0
    finally:
        if proc.poll() is None:
            stop_process(proc, 60)
    records = await asyncio.wait_for(asyncio.gather(*futures), 30)
    assert [r.status for r in records] == [RecordStatus.FINISHED] * 6
    assert all(len(r.output_token_ids[0]) == 400 and r.meta_info["worker"] == "drained" for r in records)
    assert engine_pids and not any(_alive(p) for p in engine_pids)


async def _live(r, settings, name: str) -> bool:
    from redroll.ops.control import live_workers

    return name in await live_workers(r, settings.keys)


async def _pending(r, settings, at_least: int = 1) -> bool:
    info = await r.xpending(settings.keys.requests, WORKERS_GROUP)
    return int(info["pending"]) >= at_least


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _descends_from(pid: int, ancestors: set[int]) -> bool:
    while pid > 1:
        if pid in ancestors:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


async def test_no_vllm_process_outlives_the_module():
    from tests.vllm.conftest import SESSION_WORKERS

    leftover = subprocess.run(["pgrep", "-f", "VLLM::"], capture_output=True, text=True).stdout.split()
    # (the session's gateway worker, shared with other modules, keeps its engine until the session ends)
    assert [p for p in leftover if _alive(int(p)) and not _descends_from(int(p), SESSION_WORKERS)] == []
