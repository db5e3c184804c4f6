"""Chaos: the delivery promises while workers, consumers and redis-server are killed under traffic.

A reduced run of the chaos harness (:mod:`tests.chaos`, ``python -m benchmarks.chaos``), through the same code:
separate worker and consumer processes on a private redis-server with AOF (appendfsync always),
real SIGKILL / SIGSTOP, an audit consumer group counting every record.
"""

from __future__ import annotations

import shutil

import pytest

from tests.chaos import ChaosConfig, run_chaos

pytestmark = pytest.mark.slow


@pytest.mark.timeout(170)
async def test_chaos_reduced_run_loses_and_duplicates_nothing(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (apt-get install -y redis-server)")
    cfg = ChaosConfig(requests=1000, workers=3, consumers=2, token_ms=20, jitter=0.8, max_new_tokens=10,
                      max_inflight=16, worker_kills=3, consumer_kills=1, stops=1, redis_restarts=1,
                      claim_idle_ms=1000, heartbeat_s=0.3, max_deliveries=20, appendfsync="always",
                      duration_cap=80, workdir=str(tmp_path / "chaos"))
    summary = await run_chaos(cfg)
    print(summary.to_json())  # the work directory (process logs) is kept when the run fails
    assert (summary.worker_kills, summary.stops, summary.consumer_kills, summary.redis_restarts) == (3, 1, 1, 1)
    assert summary.requests_submitted == 1000
    assert summary.quiesced, f"not every request got a record and a callback in time: {summary.examples}"
    assert summary.lost == 0, summary.examples
    assert summary.duplicate_records == 0, summary.examples
    assert summary.callbacks_missing == 0, summary.examples  # every callback applied at least once
    assert summary.records_published == 1000 and summary.callbacks_applied >= 1000
    # max_deliveries is high enough that chaos alone never dead-letters a request
    assert summary.dead_letters == 0 and summary.records_by_status == {"finished": 1000}
    assert summary.unclean_exits == []  # the final SIGTERM drains every process cleanly
    assert summary.ok
