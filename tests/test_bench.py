"""The benchmark suite runs end to end and reports every figure (it does not judge speed).

Speed is measured by ``python -m benchmarks.bench``, never asserted by a timed unit test: this test
only runs the ``--quick`` smoke variant (no peers: no network installs in tests) and checks that
each section produced all of its figures as positive numbers (differences, listed under
``signed``, only need to be finite).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("ceiling", "latency", "utilisation", "large", "memory", "fleet")
EXPECTED = {
    "ceiling": {"redroll_rps", "raw_sync_rps", "raw_async_rps", "ratio_vs_raw", "ratio_bound",
                "redroll_server_us_per_request", "raw_sync_server_us_per_request", "redroll_clients_us_per_request",
                "raw_sync_clients_us_per_request", "submit_wait_rps", "submit_wait_vs_api", "redroll_worker_cores_busy"},
    "latency": {"producer_p50_added_ms", "producer_p99_added_ms", "consumer_p50_added_ms",
                "consumer_p99_added_ms", "raw_floor_p50_ms", "raw_floor_p99_ms", "raw_floor_with_check_p50_ms",
                "raw_floor_with_check_p99_ms"},
    "utilisation": {"direct_rps", "ratio_1w", "ratio_4w", "ratio_1w_inflight_eq_slots",
                    "ratio_4w_inflight_eq_slots"},
    "large": {"encode_MBps", "decode_MBps", "record_MB", "e2e_records_per_s", "e2e_MBps", "longest_redis_command_ms"},
    "memory": {"used_memory_before_MB", "used_memory_after_processed_MB", "used_memory_after_window_MB",
               "growth_after_window_MB", "dedup_bytes_per_request"},
    "fleet": {"idle_redis_cpu_8w_lanes_off", "idle_redis_cpu_8w_lanes_on", "ceiling_4w_rps", "ceiling_8w_rps",
              "registered_8w_lanes_off_s", "registered_8w_lanes_on_s",
              "ceiling_8w_vs_4w"},
}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_bench_reports_every_figure(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (the benchmark starts its own)")
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDROLL_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench", "--quick", "--only", ",".join(SECTIONS), "--json-out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, f"bench failed ({proc.returncode}):\n{proc.stderr[-4000:]}\n{proc.stdout[-4000:]}"

    doc = json.loads(out.read_text())
    # the same document is printed on stdout after the table
    printed = json.loads(proc.stdout[proc.stdout.index("\n{") + 1:])
    assert printed["sections"].keys() == doc["sections"].keys()
    assert doc["quick"] is True and doc["machine"]["cpus"] >= 1
    assert set(doc["sections"]) == set(SECTIONS)
    for name in SECTIONS:
        section = doc["sections"][name]
        assert "error" not in section, f"{name}: {section['error']}"
        figures = section["figures"]
        missing = EXPECTED[name] - set(figures)
        assert not missing, f"{name} lacks {sorted(missing)}"
        signed = set(section.get("signed", []))
        for key, value in figures.items():
            assert isinstance(value, (int, float)) and not isinstance(value, bool), f"{name}.{key} = {value!r}"
            assert math.isfinite(value), f"{name}.{key} = {value!r}"
            if key not in signed:
                assert value > 0, f"{name}.{key} = {value!r} is not positive"
            assert section["units"][key], f"{name}.{key} has no unit"


def test_the_checkout_is_byte_compiled_also_where_python_writes_no_bytecode(tmp_path: Path, monkeypatch) -> None:
    """``compile_checkout`` writes the ``.pyc`` files pip writes at install, also under
    ``PYTHONDONTWRITEBYTECODE`` (where importing writes none), so processes the bench starts do
    not compile every module again."""
    import importlib.util

    from benchmarks.harness import compile_checkout

    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    for module in ("pkg/__init__.py", "pkg/mod.py", "pkg/sub/__init__.py"):
        (tmp_path / module).write_text("X = 1\n")
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    compile_checkout(tmp_path, ("pkg",))
    for module in ("pkg/__init__.py", "pkg/mod.py", "pkg/sub/__init__.py"):
        assert Path(importlib.util.cache_from_source(str(tmp_path / module))).is_file(), module


def test_ratio_bound_from_the_raw_runs() -> None:
    """The bound: raw asyncio clients' CPU plus redroll's redis-server CPU per request, at the
    raw sync flow's core use (here 1.5 cores: 30 us x 10,000 requests in 0.2 s)."""
    from benchmarks.sections import ratio_bound

    details = {
        "redroll": {"cpu_us_per_request": {"worker0": 40.0, "producer": 20.0, "consumer": 15.0, "redis-server": 20.0}},
        "raw_sync": {"elapsed_s": 0.2, "cpu_us_per_request": {"producer": 7.0, "worker": 10.0, "consumer": 3.0,
                                                              "redis-server": 10.0}},
        "raw_async": {"elapsed_s": 0.3, "cpu_us_per_request": {"producer": 15.0, "worker": 20.0, "consumer": 5.0,
                                                               "redis-server": 8.0}},
    }
    bound = ratio_bound(details, best_raw=50_000.0, n=10_000)
    assert bound["floor_cpu_us_per_request"] == 60.0  # 15 + 20 + 5 (raw asyncio clients) + 20 (redroll's server)
    assert bound["cores_busy_in_raw_sync"] == 1.5
    assert bound["rate"] == 25_000 and bound["ratio"] == 0.5


@pytest.mark.timeout(120)
def test_paced_raw_run_times_every_entry_through_the_three_hops(tmp_path: Path) -> None:
    """``proc_raw --rate``: one stamped entry per round trip; the consumer's report has one latency
    sample per entry, each the time from the producer's stamp to the consumer's read, and the time
    of the round trip it made after that read (the markers check's floor)."""
    from benchmarks.harness import Server
    from benchmarks.sections import raw_three_hop

    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (the benchmark starts its own)")
    server = Server()
    try:
        out = raw_three_hop(server, tmp_path, 40, "async", rate=200.0)
    finally:
        server.stop()
    samples = out["samples_ms"]
    assert len(samples) == 40
    assert all(0 < x < 5000 for x in samples)
    checks = out["check_ms"]
    assert len(checks) == 40 and all(0 < x < 5000 for x in checks)
    # Paced: 40 entries at 200/s take 195 ms (a burst of 40 takes a few). uvloop counts its timers
    # in whole milliseconds, so each sleep may end up to 1 ms early: 0.19497 s was seen.
    assert out["elapsed"] >= 39 / 200.0 - 0.005


def test_packed_arrays_cost_reports_sizes_and_times() -> None:
    from benchmarks.sections import packed_arrays_cost

    ids = [[i % 32000 for i in range(512)] for _ in range(2)]
    logprobs = [[-0.25 * (i % 7) for i in range(512)] for _ in range(2)]
    cost = packed_arrays_cost(ids, logprobs, lambda fn, min_s: (fn(), 0.001)[1], 0.0)
    assert set(cost) == {"lists_bytes", "arrays_bytes", "lists_pack_ms", "arrays_pack_ms", "lists_unpack_ms",
                         "arrays_unpack_to_lists_ms"}
    # float32 takes 4 bytes where msgpack writes a float64 in 9
    assert cost["arrays_bytes"] < cost["lists_bytes"]
    assert all(v > 0 for v in cost.values())


@pytest.mark.timeout(300)
def test_cluster_bench_runs_each_partition_count(tmp_path: Path) -> None:
    """``python -m benchmarks.cluster_bench`` on a small count: every run reports a rate, and with
    P = 3 the partitions sit on all three nodes."""
    out = tmp_path / "cluster.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.cluster_bench", "--requests", "300", "--partitions",
                           "1,3", "--json-out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=280,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [r["partitions"] for r in runs] == [1, 3]
    assert all(r["rps"] > 0 and math.isfinite(r["rps"]) for r in runs)
    assert [r["nodes_holding_partitions"] for r in runs] == [1, 3]
    assert len(runs[1]["node_cpu_us_per_request"]) == 3


def test_codec_bench_loads_a_codec_from_git_and_reports_both(tmp_path: Path) -> None:
    # (HEAD as "before": the machinery works in any clone; the real before is the default)
    out = tmp_path / "codec.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.codec_bench", "--quick", "--before", "HEAD",
                           "--json-out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    for side in ("before", "after"):
        assert all(data[side][k] > 0 for k in ("request_decode_us", "large_record_encode_ms",
                                                "large_record_decode_ms", "large_record_bytes"))
    assert "request_decode_us" in proc.stdout
