"""benchmarks/spot.py, the spot-fleet benchmark: its ledger and a smoke run (the full run takes
minutes and stays out of the suite)."""

from __future__ import annotations

import pytest

from benchmarks.spot_engine import decoded_tokens


def test_the_ledger_counts_what_a_killed_worker_decoded():
    ledger = "\n".join([
        "S 10 a.1 100.000000 2000 1 3",  # (ended: what it says)
        "E 10 a.1 101.000000 400",
        "S 11 b.1 100.000000 2000 2 3",  # (killed 0.5 s in: 500 tokens a sample at 1 ms)
        "S 11 c.1 100.000000 100 1 503",  # (killed after its budget: at most its budget)
    ])
    assert decoded_tokens(ledger, 1.0, {11: 100.5}) == (400 + 2 * 500 + 100, 3 + 3 + 503, 3)


@pytest.mark.slow
def test_a_smoke_run_loses_nothing_and_duplicates_nothing(capsys):
    from benchmarks.spot import main

    # (one mode, a worker preempted about every 0.3 s of the run: it gives notice, its standby joins)
    report = main(["--workers", "2", "--slots", "4", "--requests", "6", "--tokens", "1000", "--life-s", "3",
                   "--runs", "1", "--curve", "", "--modes", "notice", "--timeout-s", "120"])
    row = report["runs"][0]["notice"]
    assert row["lost"] == 0 and row["duplicated"] == 0 and row["not_finished"] == 0, row
    assert row["published_tokens"] == 6 * 1000 and 0 < row["goodput"] <= 1.0 and row["preemptions"] >= 1
    assert report["summary"]["notice"]["goodput"]["median"] == report["runs"][0]["notice"]["goodput"]
