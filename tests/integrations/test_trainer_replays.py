"""The HTTP calls of trainers that cannot run here (prime-rl, SkyRL, a verl agent loop), replayed against
``redroll serve`` in front of the shared fleet by ``examples/trainer_replay.py``: each request as the
client's pinned source sends it (``examples/replays/*.json`` cite file and lines), each answer checked
for the fields that client reads, each refusal for naming what it refuses.

prime-rl's and SkyRL's replays need the gateway's RL endpoints: fleet control (``/pause``,
``/update_weights``, ``/resume``), refusals by name and ``/inference/v1/generate``. A gateway without
fleet control, or without ``/inference/v1/generate`` once every other call passed, is reported as an
expected failure (xfail) naming what is missing; one with them runs every check.
"""

from __future__ import annotations

import pytest

from examples.trainer_replay import replay
from examples.trl_grpo import build_model, build_tokenizer, save_model
from redroll.engine_worker.engines.tiny_model import teacher_forced_logprobs
from redroll.producer.sync import SyncProducer
from tests.gateway_support import Served

KEY = "replay-key-0123456789"


@pytest.fixture(scope="module")
def gateway(trl_fleet, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(KEY + "\n")
    served = Served(trl_fleet.settings, "--model-name", str(trl_fleet.model_dir), "--api-key-file", str(keys),
                    log=trl_fleet.logs / "serve-replay.log")
    yield served
    served.stop()


def values(fleet, **extra):
    prompt = build_tokenizer().apply_chat_template([{"role": "user", "content": "a i q"}], add_generation_prompt=True,
                                                   tokenize=True, return_dict=True)["input_ids"]
    return {"model": str(fleet.model_dir), "prompt_ids": list(prompt), "eos_id": 1, "weight_dir": "/nonexistent",
            **extra}


def needs_fleet_control(gateway) -> None:
    """An xfail where the gateway has no fleet control yet (a 404: no such route)."""
    import httpx

    if httpx.post(gateway.url + "/resume", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).status_code == 404:
        pytest.xfail("this gateway has no fleet control (/pause, /update_weights, /resume) yet: the gateway's "
                     "part of issue 52")


def wrong_in(results: list[dict]) -> str:
    return "\n".join(f"{r['method']} {r['path']}: {'; '.join(r['wrong'])}" for r in results if r["wrong"])


def assert_replayed(results: list[dict]) -> None:
    """Every step but ``/inference/v1/generate`` (vLLM's token-in/token-out endpoint) answered as the
    client needs."""
    assert not wrong_in([r for r in results if r["path"] != "/inference/v1/generate"])


def assert_generate_replayed(results: list[dict]) -> None:
    """``/inference/v1/generate`` answered as the client needs; an xfail where the gateway has no such route."""
    generate = [r for r in results if r["path"] == "/inference/v1/generate"]
    if any(r["status"] == 404 for r in generate):
        pytest.xfail("this gateway does not serve /inference/v1/generate yet (every other call answered as the "
                     "client needs)")
    assert not wrong_in(generate)


@pytest.mark.slow
def test_a_verl_agent_loop_s_completion_call_gets_token_ids_and_logprobs(trl_fleet, gateway):
    results = replay("verl", gateway.url, values(trl_fleet), api_key=KEY)
    assert not wrong_in(results)
    choice = results[0]["response"]["choices"][0]
    assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) > 0


@pytest.mark.slow
def test_prime_rl_s_calls_and_its_pause_update_resume_cycle_move_the_fleet_to_the_step_s_weights(
        trl_fleet, gateway, tmp_path):
    needs_fleet_control(gateway)
    step_dir = tmp_path / "broadcasts" / "step_7"  # (prime-rl's step directory: the version is its step)
    save_model(str(step_dir), seed=1)
    results = replay("prime-rl", gateway.url, values(trl_fleet, weight_dir=str(step_dir)), api_key=KEY)
    assert_replayed(results)
    # The fleet now serves the checkpoint: version 7, and its logprobs are that model's.
    prompt = values(trl_fleet)["prompt_ids"]
    with SyncProducer(trl_fleet.settings) as producer:
        record = producer.generate(input_ids=prompt, return_logprob=True, sampling_params={"max_new_tokens": 8},
                                   timeout=60)
    assert record.meta_info["weight_version"] == "7"
    want = teacher_forced_logprobs(build_model(1), prompt, record.output_token_ids[0], 1.0)
    assert max(abs(a - b) for a, b in zip(want, record.output_logprobs[0])) < 1e-4
    assert_generate_replayed(results)


@pytest.mark.slow
def test_skyrl_s_calls_generate_through_the_gateway_and_its_weight_transfer_is_refused_by_name(trl_fleet, gateway):
    needs_fleet_control(gateway)
    results = replay("skyrl", gateway.url, values(trl_fleet), api_key=KEY)
    assert_replayed(results)
    assert_generate_replayed(results)


def test_every_replay_step_cites_its_source():
    from examples.trainer_replay import CLIENTS, load

    for client in CLIENTS:
        steps = load(client, values(type("F", (), {"model_dir": "m"})))["steps"]
        assert steps and all(step["source"] and step["expect"] for step in steps), client


