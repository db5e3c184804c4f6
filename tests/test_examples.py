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
