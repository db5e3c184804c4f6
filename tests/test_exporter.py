"""The pipeline-level exporter (`redroll exporter`): its figures equal `redroll status --json`'s."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from redroll.ops.status import collect_pipeline_status
from redroll.producer.client import make_request, send
from redroll.shared.lanes import set_lanes
from redroll.testing.embedded import free_port
from tests.conftest import spawn, stop_process, wait_until

pytest.importorskip("prometheus_client")


def parse(text: str) -> dict[tuple[str, tuple], float]:
    """Exposition text → {(name, ((label, value), ...)): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def scrape(port: int) -> dict[tuple[str, tuple], float] | None:
    try:
        return parse(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())
    except (urllib.error.URLError, ConnectionError):
        return None


async def exported(settings, log, *args: str) -> dict[tuple[str, tuple], float]:
    """What a ``redroll exporter`` process (``args``: more flags) exports once it is up; the process
    is stopped after and must exit cleanly."""
    port = free_port()
    proc = spawn(settings, "exporter", "--port", str(port), "--interval", "0.2", *args, log=log)
    got: dict = {}
    try:
        async def scraped() -> bool:
            nonlocal got
            got = scrape(port) or {}
            return got.get(("redroll_exporter_up", ())) == 1.0

        await wait_until(scraped, timeout=20)
    finally:
        assert stop_process(proc) in (0, -15, 143), log.read_text()
    return got


async def test_exporter_reports_backlog_with_no_worker_as_status_does(settings, r, tmp_path):
    keys = settings.keys
    await send(settings, r, [make_request(request_id=f"q-{i}", prompt="x") for i in range(3)])
    await send(settings, r, [make_request(request_id="hi", prompt="x", priority=1)])
    await r.xadd(keys.dead, {"rid": "dead-1", "reason": "test"})
    await r.hset(keys.workers, "gone-1", json.dumps({"engine": "synthetic", "seen": time.time() - 120}))
    got = await exported(settings, tmp_path / "exporter.log", "--host", "127.0.0.1")
    status = await collect_pipeline_status(r, keys, settings.partition_keys)
    assert status["queued_total"] == 4 and status["workers_alive"] == 0
    assert got[("redroll_pipeline_backlog", (("priority", "normal"),))] == status["requests"]["backlog"] == 3
    assert got[("redroll_pipeline_backlog", (("priority", "high"),))] == status["requests_high"]["backlog"] == 1
    assert got[("redroll_pipeline_backlog", (("priority", "lanes"),))] == 0
    assert sum(v for (n, _), v in got.items() if n == "redroll_pipeline_backlog") == status["queued_total"]
    assert got[("redroll_pipeline_workers_alive", ())] == status["workers_alive"] == 0
    assert got[("redroll_pipeline_workers_stale", ())] == status["workers_stale"] == 1
    assert got[("redroll_pipeline_workers", (("state", "stale"),))] == 1
    assert got[("redroll_pipeline_dead_letters", ())] == status["dead_letters"] == 1
    assert got[("redroll_redis_memory_used_bytes", (("node", ""),))] > 0
    assert not [k for k in got if k[0] == "redroll_pipeline_desired_weight_version_info"]


async def test_exporter_partitions_lanes_groups_and_weight_versions(settings, r):
    from prometheus_client import generate_latest

    from redroll.observability.exporter import PipelineMetrics

    s = settings.with_(partitions=2, affinity_lanes=2)
    keys, parts = s.keys, s.partition_keys
    await set_lanes(r, keys, parts, 2)
    await send(s, r, [make_request(request_id=f"p-{i}", prompt="x") for i in range(4)])
    await send(s, r, [make_request(request_id=f"l-{i}", prompt="x", affinity_key=f"k{i}") for i in range(3)])
    await r.xgroup_create(parts[0].results, "billing", id="0", mkstream=True)
    await r.hset(keys.weights, mapping={"model_path": "/w/v2", "weight_version": "v2"})
    now = time.time()
    for name, version in (("w-old", "v1"), ("w-new", "v2")):
        await r.hset(keys.workers, name, json.dumps({"host": "h", "engine": "synthetic", "model": "m",
                                                     "weight_version": version, "state": "paused", "inflight": 0,
                                                     "max_inflight": 8, "seen": now + 60}))
    metrics = PipelineMetrics()
    assert await metrics.refresh(r, keys, parts)
    got = parse(generate_latest(metrics.registry).decode())
    status = await collect_pipeline_status(r, keys, parts)
    assert got[("redroll_pipeline_backlog", (("priority", "normal"),))] == status["requests"]["backlog"]
    assert got[("redroll_pipeline_backlog", (("priority", "lanes"),))] == status["lanes"]["backlog"] == 3
    assert sum(v for (n, _), v in got.items() if n == "redroll_pipeline_backlog") == status["queued_total"] == 7
    for p in status["partitions"]:
        assert got[("redroll_pipeline_partition_backlog", (("partition", p["tag"]),))] == p["queued"]
    for lane in status["lanes"]["per_lane"]:
        assert got[("redroll_pipeline_lane_backlog", (("lane", str(lane["lane"])),
                                                       ("partition", lane["partition"])))] == lane["backlog"]
    assert got[("redroll_pipeline_consumer_group_lag", (("group", "billing"),))] == 0
    assert got[("redroll_pipeline_workers_alive", ())] == status["workers_alive"] == 2
    assert got[("redroll_pipeline_workers", (("state", "paused"),))] == 2
    assert got[("redroll_pipeline_desired_weight_version_info", (("model_path", "/w/v2"),
                                                                   ("weight_version", "v2")))] == 1
    assert got[("redroll_pipeline_workers_on_old_weights", ())] == 1
    served = {dict(labels)["worker"]: dict(labels)["weight_version"]
              for (n, labels), _ in got.items() if n == "redroll_pipeline_worker_info"}
    assert served == {"w-old": "v1", "w-new": "v2"}
    assert got[("redroll_pipeline_alerts", (("kind", "out_of_memory"),))] == 0


async def test_exporter_says_it_is_down_when_redis_is_unreachable(settings):
    from prometheus_client import generate_latest

    from redroll.observability.exporter import PipelineMetrics
    from redroll.shared.connection import connect

    s = settings.with_(redis_url=f"redis://127.0.0.1:{free_port()}/0")
    metrics = PipelineMetrics()
    async with connect(s) as r:
        assert not await metrics.refresh(r, s.keys, s.partition_keys)
    got = parse(generate_latest(metrics.registry).decode())
    assert got[("redroll_exporter_up", ())] == 0 and got[("redroll_exporter_snapshot_errors_total", ())] == 1
    assert not [k for k in got if k[0].startswith("redroll_pipeline_")]
