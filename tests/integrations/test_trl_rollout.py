"""TRL's ``GRPOTrainer`` (the real package, unmodified, CPU, float32) with ``rollout_func=RedrollRollout()``
trains the tiny policy through the shared fleet's two ``redroll worker`` processes.

``examples/trl_grpo.py train`` runs the trainer and checks each rollout call from inside: every
record was generated on weight version = the step (pushed by that call), and the trainer model's
teacher-forced logprobs of the completions (logits / temperature; the transformers engine reports
temperature-scaled logprobs) equal the records' within 1e-4. Here: those checks for every step,
the push reaching both workers, and the mean reward rising over the run; once with one trainer
process, once with two (``accelerate launch``, gloo on CPU).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

STEPS = 8
LEARN = ["--steps", str(STEPS), "--lr", "1e-2", "--batch", "16", "--generations", "4", "--max-tokens", "12"]


def run(fleet, argv: list[str], out, timeout: float = 240) -> list[dict]:
    proc = subprocess.run(argv + ["--model", str(fleet.model_dir), "--out", str(out), *LEARN], cwd=ROOT,
                          env=fleet.env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:] + fleet.tails()
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def assert_on_policy(report: dict, prompts_per_call: int, pushes: bool) -> None:
    checks = report["checks"]
    assert [c["step"] for c in checks] == list(range(STEPS))  # one rollout call per step
    for c in checks:
        assert c["prompts"] == prompts_per_call
        assert c["versions"] == [c["step"]], c  # every record generated on this step's weights
        assert c["parity_max_abs"] < 1e-4, c  # ... and those are the trainer's weights
        if pushes:
            assert c["pushed"] == c["step"] and c["push_workers"] == 2
        else:
            assert c["pushed"] is None  # (only the main process pushes)


def assert_learned(report: dict) -> None:
    rewards = [r["reward"] for r in report["rewards"]]
    assert len(rewards) == STEPS
    print(f"rewards ({report['world']} process(es)):", " ".join(f"{x:.3f}" for x in rewards))
    assert report["last"] > report["first"] + 0.05, rewards


@pytest.mark.slow
def test_grpo_trainer_learns_through_worker_processes_on_the_step_s_weights(trl_fleet, tmp_path):
    (report,) = run(trl_fleet, [sys.executable, "examples/trl_grpo.py", "train"], tmp_path / "one")
    assert report["world"] == 1
    assert_on_policy(report, prompts_per_call=16, pushes=True)
    assert_learned(report)


@pytest.mark.slow
def test_two_trainer_processes_each_submit_their_slice_and_the_main_one_pushes(trl_fleet, tmp_path):
    # `accelerate launch --cpu --num_processes 2` starts ONE process (accelerate's simple launcher,
    # accelerate/commands/launch.py); --multi_gpu takes the torchrun launcher, and with
    # GRPOConfig(use_cpu=True) accelerate picks MULTI_CPU with the gloo backend on a machine without GPUs.
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "examples/trl_grpo.py", "train"]
    main, other = run(trl_fleet, launch, tmp_path / "two", timeout=300)
    assert (main["rank"], other["rank"], main["world"]) == (0, 1, 2)
    assert_on_policy(main, prompts_per_call=8, pushes=True)
    assert_on_policy(other, prompts_per_call=8, pushes=False)
    assert_learned(main)
