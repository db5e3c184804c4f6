"""The baseline the large-record target compares with: the commit's own tree and its own bench."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from benchmarks.baseline import LARGE_BASELINE, BaselineUnavailable, checkout, large_run
from benchmarks.harness import ROOT


def _has_history() -> bool:
    return subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{LARGE_BASELINE}^{{commit}}"],
                          capture_output=True).returncode == 0


needs_history = pytest.mark.skipif(not _has_history(), reason=f"this checkout lacks commit {LARGE_BASELINE}")


@needs_history
def test_the_baseline_is_the_commits_own_tree(tmp_path: Path) -> None:
    src = checkout(LARGE_BASELINE, tmp_path)
    assert (src / "benchmarks" / "bench.py").exists()
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", LARGE_BASELINE],
                            capture_output=True, text=True, check=True).stdout.split()
    assert sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file()) == sorted(listed)
    assert checkout(LARGE_BASELINE, tmp_path) == src  # once per run


def test_a_commit_not_in_the_history_is_unavailable_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(BaselineUnavailable, match="not in this checkout's history"):
        checkout("0" * 40, tmp_path)


@needs_history
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_baseline_runs_its_own_large_section(tmp_path: Path) -> None:
    got = large_run(checkout(LARGE_BASELINE, tmp_path), tmp_path / "baseline.json", quick=True)
    assert got["figures"]["e2e_records_per_s"] > 0
    assert set(got["cpu_us_per_record"]) >= {"consumer", "redis-server"}
