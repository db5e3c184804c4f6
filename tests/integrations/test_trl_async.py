"""TRL's async GRPO (``trl.experimental.async_grpo.AsyncGRPOTrainer``, the real package) trains on
CPU with ``weight_transfer=RedrollWeightTransfer()``: its rollout process samples through
``redroll serve``'s ``/v1/completions`` in front of the shared fleet, and every weight sync the
trainer makes (the cold one, then one per optimizer step) goes through the transfer to both
worker processes. ``examples/trl_async_grpo.py`` runs it (with the CPU shims it names, none of
which touches weights or rollouts) and then checks, through the Python API, that the workers serve
the last version pushed and that their logprobs are the trained model's (within 1e-4).
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.conftest import ROOT
from tests.gateway_support import Served

STEPS = 3


@pytest.mark.slow
def test_async_grpo_trains_and_its_weight_syncs_reach_the_worker_processes(trl_fleet, tmp_path):
    # TRL's rollout process names the model by its path (get_config_model_id): the gateway serves that name.
    served = Served(trl_fleet.settings, "--model-name", str(trl_fleet.model_dir), log=tmp_path / "serve.log")
    try:
        out = tmp_path / "async.json"
        argv = [sys.executable, "examples/trl_async_grpo.py", "--model", str(trl_fleet.model_dir),
                "--base-url", served.url, "--steps", str(STEPS), "--out", str(out)]
        if "max_model_len" not in httpx.get(served.v1 + "/models", timeout=30).json()["data"][0]:
            # A gateway without vLLM's RL fields (the gateway's part of issue 52) refuses TRL's default
            # `top_k: 0` and lists no `max_model_len`: the run says top_k -1 (also "off") and its token budget.
            argv += ["--top-k", "-1", "--token-budget", "256"]
        proc = subprocess.run(argv, cwd=ROOT, env=trl_fleet.env(), capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:] + trl_fleet.tails()
        report = json.loads(out.read_text())
    finally:
        served.stop()
    print(json.dumps({k: report[k] for k in ("rewards", "pushed", "seconds")}))
    assert report["steps"] == STEPS
    # TRL's own calls: init, the cold sync, one sync per optimizer step, destroy (async_grpo_trainer.py:217-234, 1751-1800).
    assert report["calls"] == ["init_weight_transfer"] + ["pause", "send_weights", "resume"] * (STEPS + 1) + ["destroy"]
    assert report["pushed"] == list(range(1, STEPS + 2)) and report["model_version"] == STEPS + 1
    assert report["push_workers"] == [2] * (STEPS + 1)
    assert len(report["rewards"]) == STEPS  # (samples came back through the gateway and were trained on)
    assert report["served_versions"] == [str(STEPS + 1)] and report["served_parity_max_abs"] < 1e-4
