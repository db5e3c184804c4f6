"""The GPU throughput check script runs on CPU with the tiny model, so it cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_throughput_check_runs_on_cpu(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "tp.json"
    proc = subprocess.run([sys.executable, "scripts/throughput_check.py", "--engine", "transformers",
                           "--model-path", "tiny-random", "--requests", "32", "--max-new-tokens", "8",
                           "--concurrency", "16", "--json-out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for name in ("pipeline", "direct"):
        assert result[name]["tokens"] == 32 * 8 and result[name]["failed"] == 0
        assert result[name]["tokens_per_s"] > 0
    assert result["ratio"] > 0
    assert "ratio" in proc.stdout and "pipeline" in proc.stdout and "direct" in proc.stdout
