"""The peers section's pure parts: the comparison over repeated runs, and every peer's command lines.

Nothing here installs or runs a peer (no network installs in tests).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.peers_section import PEERS, _peer_argv, compare


def test_compare_takes_medians_and_each_runs_fastest_peer():
    rounds = [
        {"arq": 1000.0, "bullmq": 1500.0, "redroll": 30000.0},
        {"arq": 2000.0, "bullmq": 1000.0, "redroll": 25000.0},  # arq the fastest in this run
        {"arq": 1100.0, "bullmq": 1400.0, "redroll": 28000.0},
    ]
    c = compare(rounds)
    assert c["median"] == {"arq": 1100.0, "bullmq": 1400.0, "redroll": 28000.0}
    assert c["min"]["bullmq"] == 1000.0 and c["max"]["arq"] == 2000.0
    assert c["best_peer"] == "bullmq"  # by median, although arq had the single fastest run
    assert c["fastest_per_round"] == ["bullmq", "arq", "bullmq"]
    assert c["ratio_per_round"] == pytest.approx([20.0, 12.5, 20.0])
    assert c["ratio_min"] == pytest.approx(12.5)
    assert c["ratio_median"] == pytest.approx(20.0)


def test_compare_without_peers_has_only_redroll():
    c = compare([{"redroll": 100.0}, {"redroll": 300.0}])
    assert c["median"] == {"redroll": 200.0}
    assert "best_peer" not in c


@pytest.mark.parametrize("peer", [*PEERS, "redroll"])
@pytest.mark.parametrize("role", ["worker", "consumer", "producer"])
def test_every_peer_has_a_command_for_every_role(peer, role):
    py = Path("/venv/bin/python")
    argv = _peer_argv(peer, py, role, 300, Path("/run/producer.json"))
    assert argv[0].startswith("/venv/bin/")
    if role == "producer":
        assert "300" in argv and "/run/producer.json" in argv


def test_redroll_runs_beside_the_peers_as_its_users_run_it():
    """The suite's peers row for redroll is what a user starts: a producer script of the public API,
    ``redroll worker`` and ``redroll consume`` command lines (no suite tooling)."""
    py = Path("/venv/bin/python")
    assert _peer_argv("redroll", py, "worker", 1, Path("/o"))[1:] == [
        "-m", "redroll.cli", "worker", "--engine", "synthetic", "--max-inflight", "256"]
    assert _peer_argv("redroll", py, "consumer", 1, Path("/o"))[1:5] == ["-m", "redroll.cli", "consume", "--group"]
    source = (Path(__file__).resolve().parents[1] / "benchmarks" / "peers" / "peer_redroll.py").read_text()
    assert "from redroll import Settings, make_request, send" in source and "asyncio.run(" in source
    assert "benchmarks.harness" not in source and "proc_producer" not in source
