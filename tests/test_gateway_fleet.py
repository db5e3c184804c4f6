"""``redroll serve``'s fleet control, driven with the exact requests prime-rl's orchestrator sends to
its inference servers, against real worker processes; and several models behind one gateway.

prime-rl is not on the registry: its calls are read from PrimeIntellect-ai/prime-rl at commit
559b44772e471d1538537b8805cc77f3824a5e64 (src/prime_rl/utils/client.py):

* ``POST /pause?mode=keep&clear_cache=false``, no body (client.py:258), then
* ``POST /update_weights {"weight_dir": "<output_dir>/broadcasts/step_<N>"}`` (client.py:310-315;
  the step dirs: utils/pathing.py:109-114), then, in ``finally``,
* ``POST /resume``, no body (client.py:270, 319-320),

each with ``Authorization: Bearer $VLLM_API_KEY`` (client.py:142-144).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from redroll.engine_worker.worker import Worker  # noqa: E402
from redroll.producer.models import ModelRouter, UnknownModelError  # noqa: E402
from redroll.shared.connection import connect  # noqa: E402
from redroll.web.gateway.fleet import REFUSED, version_for  # noqa: E402
from tests.conftest import ROOT, redroll_env, running, spawn, stop_process, wait_until  # noqa: E402
from tests.gateway_support import CountingEngine, Served  # noqa: E402

KEY = "fleet-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


async def workers_hash(r, settings) -> dict[str, dict]:
    """The workers' heartbeats (``{ns}:workers``), by name."""
    return {k.decode(): json.loads(v) for k, v in (await r.hgetall(settings.keys.workers)).items()}


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    path.write_text(f"# the orchestrator's VLLM_API_KEY\n{KEY}\n")
    return path


def status_json(settings) -> dict:
    out = subprocess.run([sys.executable, "-m", "redroll.cli", "status", "--json"], cwd=ROOT,
                         env=redroll_env(settings), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


async def test_prime_rls_pause_update_resume_cycle_while_requests_run(settings, key_file, tmp_path):
    """Two worker processes generate long requests; prime-rl's pause (keep) stops the fleet claiming
    while those run on; its update_weights swaps the weights under them (their records name both
    versions, per token) and sets the version from the step dir; a request sent while paused
    waits, unclaimed, and runs on the new weights after the resume; late joiners read it all."""
    procs = [spawn(settings, "worker", "--engine", "synthetic", "--token-ms", "25", "--max-inflight", "8",
                   "--name", f"fleet-{i}", log=tmp_path / f"worker-{i}.log") for i in range(2)]
    gateway = Served(settings, "--api-key-file", str(key_file), "--host", "127.0.0.1", log=tmp_path / "serve.log")
    r = connect(settings)
    client = openai.AsyncOpenAI(base_url=gateway.v1, api_key=KEY, max_retries=0, timeout=120)
    http = httpx.AsyncClient(base_url=gateway.url, headers=AUTH, timeout=120)
    try:
        await wait_until(lambda: _live(r, settings, 2), timeout=60, what="two workers")
        long = [asyncio.create_task(client.completions.create(
            model="redroll", prompt=f"long {i}", max_tokens=160, extra_body={"ignore_eos": True}))
            for i in range(4)]
        await wait_until(lambda: _inflight(r, settings, 4), timeout=30, what="the long requests running")

        paused = await http.post("/pause", params={"mode": "keep", "clear_cache": "false"})
        assert paused.status_code == 200, paused.text
        assert paused.json()["status"] == "paused" and sorted(paused.json()["workers"]) == ["fleet-0", "fleet-1"]
        beats = await workers_hash(r, settings)
        assert {b["state"] for b in beats.values()} == {"paused"}
        assert (await http.get("/is_paused")).json()["is_paused"] is True

        waiting = asyncio.create_task(client.completions.create(model="redroll", prompt="sent while paused",
                                                                max_tokens=4))
        await wait_until(lambda: _queued(r, settings, 5), timeout=10, what="the paused call queued")

        update = await http.post("/update_weights", json={"weight_dir": str(tmp_path / "broadcasts" / "step_3")})
        assert update.status_code == 200, update.text
        assert update.json()["weight_version"] == "3" and update.json()["mode"] == "in_place"
        beats = await workers_hash(r, settings)
        assert {b["weight_version"] for b in beats.values()} == {"3"} and {b["state"] for b in beats.values()} == {
            "paused"}
        status = status_json(settings)
        assert {w["weight_version"] for w in status["workers"]} == {"3"}

        ran_on = [await t for t in long]  # (kept: they ran on through the pause, the swap inside them)
        for out in ran_on:
            versions = out.choices[0].model_extra["weight_versions"]
            assert len(versions) == 160 and versions[0] == "0" and versions[-1] == "3", versions
            assert out.model_extra["weight_version"] == "3"
        # (a 4-token request that ran would have ended long before these 160-token ones: it waits,
        # the one entry left; a worker whose claim was under way when the pause came holds it, unstarted)
        assert not waiting.done() and await r.xlen(settings.keys.requests) == 1

        resumed = await http.post("/resume")
        assert resumed.status_code == 200 and resumed.json()["status"] == "resumed", resumed.text
        late = await waiting
        assert late.model_extra["weight_version"] == "3" and "weight_versions" not in late.choices[0].model_extra
        assert {b["state"] for b in (await workers_hash(r, settings)).values()} == {"running"}
        assert (await http.get("/is_paused")).json() == {"is_paused": False, "mode": None,
                                                         "workers": {"fleet-0": "running", "fleet-1": "running"}}

        # another step: no step dir in the path, so the version goes up by one; then a late joiner
        # starts paused at the desired weights
        again = await http.post("/update_weights", json={"weight_dir": str(tmp_path / "ckpt-latest")})
        assert again.json()["weight_version"] == "4"
        assert (await http.post("/pause", params={"mode": "wait", "clear_cache": "false"})).status_code == 200
        procs.append(spawn(settings, "worker", "--engine", "synthetic", "--name", "fleet-late",
                           log=tmp_path / "worker-late.log"))
        await wait_until(lambda: _live(r, settings, 3), timeout=60, what="the late joiner")
        beats = await workers_hash(r, settings)
        assert beats["fleet-late"]["state"] == "paused" and beats["fleet-late"]["weight_version"] == "4"
        assert (await http.post("/resume")).status_code == 200
    finally:
        await http.aclose()
        await client.close()
        gateway.stop()
        for proc in procs:
            stop_process(proc, 30)
        await r.aclose()


async def _live(r, settings, n: int) -> bool:
    raw = await r.hgetall(settings.keys.workers)
    return len(raw) >= n and all(json.loads(v).get("state") for v in raw.values())


async def _inflight(r, settings, n: int) -> bool:
    return sum(json.loads(v)["inflight"] for v in (await r.hgetall(settings.keys.workers)).values()) >= n


async def _queued(r, settings, n: int) -> bool:
    return await r.xlen(settings.keys.requests) >= n


async def test_fleet_control_needs_keys_and_refuses_what_it_cannot_take(settings, key_file, tmp_path):
    """An open gateway refuses fleet control (and says how to enable it); with keys, a call without
    one is 401; a null weight_dir (prime-rl's NIXL mode), vLLM's update_info, a pause that would
    clear caches, an unknown parameter and vLLM's or SkyRL's weight-transfer routes are refused
    in one line naming what."""
    open_gateway = Served(settings, log=tmp_path / "open.log")
    try:
        refused = httpx.post(open_gateway.url + "/pause", params={"mode": "keep", "clear_cache": "false"})
        assert refused.status_code == 403 and "--api-key-file" in refused.json()["error"]["message"]
    finally:
        open_gateway.stop()
    gateway = Served(settings, "--api-key-file", str(key_file), "--host", "127.0.0.1", log=tmp_path / "serve.log")
    try:
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            assert http.post("/pause", params={"mode": "keep"}).status_code == 401
            cases = [
                ("/update_weights", {}, {"weight_dir": None}, 400, "weight_dir", "NCCL or NIXL"),
                ("/update_weights", {}, {}, 400, "weight_dir", "is required"),
                ("/update_weights", {}, {"update_info": {"names": ["w"]}}, 400, "update_info", "weight_dir"),
                ("/update_weights", {}, {"weight_dir": "/x", "surprise": 1}, 400, "surprise", "unknown field"),
                ("/pause", {"mode": "abort"}, None, 400, "clear_cache", "false"),  # (vLLM's default is true)
                ("/pause", {"mode": "freeze", "clear_cache": "false"}, None, 400, "mode", "keep, wait, abort"),
                ("/pause", {"mode": "keep", "tags": "x"}, None, 400, "tags", "unknown query parameter"),
            ]
            for path, params, body, status, param, words in cases:
                out = http.post(path, params=params, json=body, headers=AUTH)
                error = out.json()["error"]
                assert (out.status_code, error["param"]) == (status, param), (path, out.text)
                assert words in error["message"] and "\n" not in error["message"]
            for path in ("/init_weight_transfer_engine", "/collective_rpc", "/get_world_size", "/init_broadcaster",
                         "/start_weight_update", "/fetch_weights", "/v1/load_lora_adapter"):
                out = http.post(path, json={"init_info": {"master_address": "x"}}, headers=AUTH)
                assert out.status_code == 501, (path, out.text)
                assert path in out.json()["error"]["message"] and REFUSED[path] in out.json()["error"]["message"]
            assert http.get("/get_world_size", headers=AUTH).status_code == 501
    finally:
        gateway.stop()


def test_the_version_a_weight_dir_sets():
    assert version_for("/runs/a/broadcasts/step_12", None, "3") == "12"
    assert version_for("/runs/a/checkpoints/step_7/weight", None, "3") == "7"
    assert version_for("/ckpt/latest", None, "3") == "4"
    assert version_for("/ckpt/latest", None, None) == "1" == version_for("/ckpt/latest", None, "initial")
    assert version_for("/runs/a/broadcasts/step_12", 40, "3") == "40"


async def test_two_models_behind_one_gateway_each_answered_by_its_own_workers(settings, tmp_path):
    """A policy and its judge, two pipelines (namespaces) with workers of their own, behind one
    gateway: ``/v1/models`` lists the policy first with its context length; a call is answered by
    the workers of the model it names (none: the policy); an unknown model is a 404, unless a
    default model takes it; the Python API routes the same way."""
    judge_settings = settings.with_(namespace=settings.namespace + "-judge")
    policy_engine, judge_engine = CountingEngine(), CountingEngine()
    policy_engine.info.max_context, judge_engine.info.max_context = 4096, 2048
    models = f"policy={settings.namespace},judge={judge_settings.namespace}"
    gateway = Served(settings, "--model", f"policy={settings.namespace}", "--model", f"judge={judge_settings.namespace}",
                     log=tmp_path / "serve.log")
    defaulted = Served(settings, "--default-model", "policy", log=tmp_path / "serve2.log", REDROLL_MODELS=models)
    client = openai.AsyncOpenAI(base_url=gateway.v1, api_key="unused", max_retries=0, timeout=60)
    try:
        async with running(Worker(settings, policy_engine, max_inflight=8, block_ms=100),
                           Worker(judge_settings, judge_engine, max_inflight=8, block_ms=100)):
            cards = (await client.models.list()).data
            assert [c.id for c in cards] == ["policy", "judge"]
            await wait_until(lambda: _model_lengths(client, {"policy": 4096, "judge": 2048}), timeout=20,
                             what="max_model_len on the cards")
            rollout = await client.completions.create(model="policy", prompt="2+2=", max_tokens=4)
            verdict = await client.chat.completions.create(
                model="judge", messages=[{"role": "user", "content": f"grade: {rollout.choices[0].text}"}],
                max_tokens=3)
            async with httpx.AsyncClient(base_url=gateway.v1, timeout=60) as http:  # (a call that names no model)
                unnamed = (await http.post("/completions", json={"prompt": "unnamed", "max_tokens": 2})).json()
            assert rollout.model == "policy" and verdict.model == "judge" and unnamed["model"] == "policy"
            assert sum(policy_engine.started.values()) == 2 and sum(judge_engine.started.values()) == 1
            with pytest.raises(openai.NotFoundError) as missing:
                await client.completions.create(model="/ckpt/tiny", prompt="x", max_tokens=2)
            assert "'/ckpt/tiny'" in str(missing.value) and "'policy', 'judge'" in str(missing.value)
            # a client that sends its own config name (a checkpoint path) reaches the default model
            async with openai.AsyncOpenAI(base_url=defaulted.v1, api_key="unused", max_retries=0) as other:
                routed = await other.completions.create(model="/ckpt/tiny", prompt="x", max_tokens=2)
                assert routed.model == "/ckpt/tiny" and sum(policy_engine.started.values()) == 3

            async with ModelRouter(settings.with_(models=models)) as router:
                assert router.models == ["policy", "judge"]
                judged = await router.generate(model="judge", prompt="grade this", timeout=30)
                rolled = await router.generate(prompt="roll out", timeout=30)
                assert judged.ok and rolled.ok
                assert sum(judge_engine.started.values()) == 2 and sum(policy_engine.started.values()) == 4
                with pytest.raises(UnknownModelError):
                    await router.submit(model="nobody", prompt="x")
    finally:
        await client.close()
        gateway.stop()
        defaulted.stop()


async def _model_lengths(client, want: dict[str, int]) -> bool:
    cards = (await client.models.list()).data
    return {c.id: (c.model_extra or {}).get("max_model_len") for c in cards} == want
