"""``benchmarks.worker_drain``: one drain.

Speed is not judged here (the bench prints it); this checks that the worker drains every request
it was given and that the figures are taken.
"""

from __future__ import annotations

import pytest

from benchmarks.harness import Server
from benchmarks.worker_drain import drain


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_worker_drains_every_queued_request(tmp_path):
    server = Server()
    try:
        run = drain(server, tmp_path, 3_000, 500)
        assert server.r.xlen("{bench}:results") == 3_000
        assert server.r.xlen("{bench}:requests") == 0
    finally:
        server.stop()
    assert run["rate"] > 0 and run["worker_us"] > 0 and run["redis_us"] > 0
