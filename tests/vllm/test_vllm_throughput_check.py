"""The throughput check runs with vLLM (small, so it cannot rot; the figure itself comes from a
full run: docs/performance.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def test_the_throughput_check_runs_with_vllm(tmp_path, tiny_checkpoints):
    out = tmp_path / "tp.json"
    proc = subprocess.run([sys.executable, "scripts/throughput_check.py", "--engine", "vllm", "--model-path",
                           str(tiny_checkpoints[0]), "--dtype", "float32", "--requests", "32", "--max-new-tokens", "8",
                           "--concurrency", "32", "--pairs", "2", "--json-out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["pairs"]) == 2
    for pair in result["pairs"]:
        for side in ("pipeline", "direct"):
            assert pair[side]["tokens"] == 32 * 8 and pair[side]["failed"] == 0
    low, high = result["ratio_range"]
    assert low <= result["ratio"] <= high and "median of 2 alternated pairs" in proc.stdout
