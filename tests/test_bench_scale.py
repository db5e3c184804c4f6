"""Smoke runs of the scale benchmarks (backlog, capacity, one checkpoint call, outside-style three processes): each
runs end to end on tiny counts and reports every figure. They measure nothing here: the figures
come from full runs on a quiet machine (docs/capacity.md)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("REDROLL_")}, "PYTHONPATH": str(ROOT)}


def run_bench(module: str, *args: str, tmp_path: Path, timeout: int = 120) -> dict:
    out = tmp_path / f"{module}.json"
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args, "--json-out", str(out)], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(120)
def test_backlog_reports_memory_and_latency_per_level(tmp_path: Path) -> None:
    doc = run_bench("backlog", "--levels", "200,2000", "--samples", "20", "--records", "100", tmp_path=tmp_path)
    assert [row["queued"] for row in doc["levels"]] == [200, 2000]
    for row in doc["levels"]:
        assert 100 < row["bytes_per_queued_request"] < 5000 and row["rid_key_bytes"] > 0
        for name in ("submit_ms", "claim_lua_ms", "claim_plain_ms"):
            assert 0 < row[name]["p50"] <= row[name]["p99"] <= row[name]["max"]
    assert doc["kept_records"]["records"] == 100 and doc["kept_records"]["bytes_per_kept_record"] > 0
    assert all(math.isfinite(v) and v > 0 for v in doc["figures"].values())
    assert doc["payload"]["request_fields_bytes"]["data"] > 0


@pytest.mark.timeout(180)
def test_capacity_check_measures_and_predicts(tmp_path: Path) -> None:
    small = ["--workers", "2", "--per-worker", "1", "--tokens", "16", "--token-ms", "5", "--seconds", "2",
             "--warmup-s", "1", "--runs", "1"]
    check = run_bench("capacity_check", *small, tmp_path=tmp_path)
    [run] = check["runs"]
    assert run["workers"] == 2 and run["tokens_per_s"] > 0 and run["chunks_per_s"] > 0
    assert run["redis_share"] > 0 and run["predicted_redis_share"] > 0 and run["predicted_over_measured"] > 0
    measured = run_bench("capacity_check", "--measure", *small, "--measure-workers", "2", "--measure-per-worker", "1",
                         "--measure-tokens", "16", "--measure-token-ms", "5", tmp_path=tmp_path)
    [run] = measured["runs"]
    assert {"request_us", "chunk_us", "chunk_call_us", "idle_worker_us", "chunk_timer_extra_ms"} <= set(run)
    assert run["awaited"]["requests_per_s"] > 0 and run["streamed"]["chunks_per_s"] > 0
    # (the second streamed run has 2 requests a worker where the first has 1: another number of chunks a write)
    assert run["streamed_other"]["streams"] == 2 * run["streamed"]["streams"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape", [[], ["--logged"], ["--streamed"]])
def test_checkpoint_call_reports_a_saves_cost(tmp_path: Path, shape: list[str]) -> None:
    doc = run_bench("checkpoint_call", "--saves", "4", "--calls", "4", *shape, tmp_path=tmp_path)
    assert doc["part_bytes"] > 0 and doc["redis_cpu_usec_per_save"] >= 0
    assert 0 < doc["function_usec_per_save_min"] <= doc["function_usec_per_save"]


@pytest.mark.timeout(120)
def test_outside_runs_redroll_as_a_user_does(tmp_path: Path) -> None:
    doc = run_bench("outside", "--only", "redroll", "--jobs", "200", "--runs", "1", tmp_path=tmp_path)
    [run] = doc["rounds"]
    assert run["redroll"]["from_first_enqueue"] > 0 and run["redroll"]["producer_start_s"] > 0
    assert doc["from_first_enqueue"]["redroll"]["median"] > doc["from_producer_start"]["redroll"]["median"]
