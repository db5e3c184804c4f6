"""The GRPO-style example runs end to end on CPU, as the README says."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_grpo_example_runs_end_to_end(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "rollouts.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDROLL_")}
    proc = subprocess.run([sys.executable, "examples/grpo_rollout.py", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = json.loads(proc.stdout)
    assert stats["groups"] == 64 and stats["accepted"] == 64 * 6
    assert sum(stats[k] for k in ("accepted", "aborted", "rejected", "surplus", "failed")) == 64 * 8
    assert stats["versions"] == ["0", "1"]  # the weight update happened mid-run
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    kept = [r for r in rows if r.get("status") != "aborted"]
    assert len(kept) == 64 * 6
    assert all(len(r["output_token_ids"]) == len(r["output_logprobs"]) for r in kept)
    assert {r["weight_version"] for r in kept} == {"0", "1"}


@pytest.mark.slow
def test_grpo_learn_learns_through_the_queue_with_logprob_parity(tmp_path):
    # The short run of examples/grpo_learn.py: a trainer, 2 worker processes, a weight push over
    # gloo after every optimizer step; rewards and parity from the records.
    pytest.importorskip("torch")
    out = tmp_path / "grpo.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDROLL_")}
    proc = subprocess.run([sys.executable, "examples/grpo_learn.py", "--seeds", "0", "--steps", "8",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)["seeds"]["0"]
    assert result["gain"] >= 0.3 and result["parity_max_abs"] < 1e-4
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["version"] for r in rows] == list(range(1, 9))  # one push per step, records on it
    assert all(r["parity_max_abs"] < 1e-4 and r["on_version"] == r["samples"] == 64 for r in rows)
    assert all(r["staleness"]["max"] == 0 and r["push_workers"] == 2 for r in rows)
    assert len({w for r in rows for w in r["workers"]}) == 2  # both served (a worker may claim a whole step)


@pytest.mark.slow
def test_the_agent_example_records_a_tool_using_episode_as_trainers_take_it(tmp_path):
    """examples/agent_rollout.py: a 3-turn calculator episode through the openai SDK against the
    gateway (a scripted tiny model, the real template and parser): the calls, the answer, one
    token sequence whose mask covers exactly the model's tokens, and the per-turn masks and
    logprobs printed."""
    pytest.importorskip("torch")
    pytest.importorskip("openai")
    out = tmp_path / "episodes.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDROLL_")}
    proc = subprocess.run([sys.executable, "examples/agent_rollout.py", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert row["reward"] == 1.0 and row["num_turns"] == 3
    assert [[c["name"] for c in t["tool_calls"]] for t in row["turns"]] == [["add"], ["mul"], []]
    assert row["turns"][-1]["content"] == "(2+3)*4 = 20."
    n = len(row["response_ids"])
    assert len(row["response_mask"]) == len(row["response_logprobs"]) == n
    assert sum(row["response_mask"]) == sum(len(t["completion_ids"]) for t in row["turns"])
    assert all(lp == 0.0 for lp, m in zip(row["response_logprobs"], row["response_mask"]) if not m)
    assert all(lp <= 0.0 for lp in row["response_logprobs"])
    lines = proc.stdout.splitlines()
    assert sum(line.strip().startswith("turn ") and "mask " in line for line in lines) == 3
    assert sum("logprobs [" in line for line in lines) == 3
