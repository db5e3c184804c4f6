"""The pipeline-level Prometheus exporter: ``redroll exporter --port N [--interval S]`` (``redroll[metrics]``).

Workers and consumers export what they do themselves (:mod:`redroll.observability.metrics`); this process
exports what only Redis knows, whether or not any worker runs: the backlog with no worker, the dead
letters, the desired weight version, Redis's memory. Every ``--interval`` seconds it takes one snapshot
through :func:`redroll.ops.status.collect_pipeline_status` (the code behind ``redroll status --json``, so
the two always agree) plus the desired weights (``{ns}:weights``) and ``INFO memory``; each scrape of
``/metrics`` reads the latest snapshot (scrapes never touch Redis). Run one per pipeline.

Pipeline figures (gauges; absent while the last snapshot failed, see ``redroll_exporter_up``):
    redroll_pipeline_backlog{priority}        entries not yet delivered to any worker: priority is
                                              normal (the request streams), high, or lanes (the
                                              affinity lanes); their sum is status's queued_total
    redroll_pipeline_in_flight{priority}      entries delivered and not yet acknowledged (XPENDING)
    redroll_pipeline_oldest_pending_idle_seconds  idle time of the oldest in-flight normal entry
    redroll_pipeline_oldest_pending_age_seconds   age (since submit) of the oldest in-flight normal entry
    redroll_pipeline_pending_by_deliveries{deliveries}  in-flight normal entries by delivery count
    redroll_pipeline_partition_backlog{partition}       with partitions: normal backlog per partition
    redroll_pipeline_partition_in_flight{partition}     with partitions: in flight per partition
    redroll_pipeline_partition_dead_letters{partition}  with partitions: dead letters per partition
    redroll_pipeline_lane_backlog{partition,lane}       with affinity lanes: backlog per lane
    redroll_pipeline_lane_in_flight{partition,lane}     with affinity lanes: in flight per lane
    redroll_pipeline_dead_letters             entries in the dead-letter stream(s)
    redroll_pipeline_results                  records in the results stream(s)
    redroll_pipeline_aborted_ids              request ids marked aborted
    redroll_pipeline_consumer_group_pending{group}    results read by a consumer group, not yet acked
    redroll_pipeline_consumer_group_lag{group}        results a consumer group has not read yet
    redroll_pipeline_consumer_group_consumers{group}  consumers in the group
    redroll_pipeline_requests_per_second      records published per second (live workers' 1-minute rates)
    redroll_pipeline_tokens_per_second        output tokens per second (same)
    redroll_pipeline_workers_alive            workers whose heartbeat is fresh
    redroll_pipeline_workers_stale            workers whose heartbeat is older than status's STALE_AFTER_S
    redroll_pipeline_workers{state}           live workers by state (running, draining, paused, blocked,
                                              ...); stale ones count as state="stale"
    redroll_pipeline_worker_info{worker,host,engine,model,state,weight_version}  1 per live worker
    redroll_pipeline_worker_in_flight{worker}         requests it generates now (its heartbeat)
    redroll_pipeline_worker_capacity{worker}          its max_inflight
    redroll_pipeline_worker_pending{worker}           normal entries XPENDING holds for it
    redroll_pipeline_worker_tokens_per_second{worker} its 1-minute token rate
    redroll_pipeline_worker_heartbeat_age_seconds{worker}  seconds since its last heartbeat (stale ones too)
    redroll_pipeline_desired_weight_version_info{weight_version,model_path}  1; absent until
                                              ``redroll weights update`` sets one
    redroll_pipeline_workers_on_old_weights   live workers serving another version than the desired one
                                              (0 when none is desired)
    redroll_pipeline_alerts{kind}             what status's alerts say stops the pipeline now:
                                              out_of_memory, stream_refusing (a key of another type,
                                              exhausted ids), worker_blocked (a worker whose writes are refused)
    redroll_redis_memory_used_bytes{node}     INFO memory used_memory (node="" on a single server)
    redroll_redis_memory_max_bytes{node}      maxmemory (0 = no limit)
    redroll_redis_memory_noeviction{node}     1 when maxmemory_policy is noeviction (writes refused when full)
Exporter figures:
    redroll_exporter_up                       1 when the last snapshot succeeded
    redroll_exporter_last_success_timestamp_seconds  when the last snapshot succeeded (unix time)
    redroll_exporter_snapshot_seconds         how long the last snapshot took
    redroll_exporter_snapshot_errors_total    snapshots that failed (Redis unreachable, refused)
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Iterable

import redis
from redis.asyncio import Redis

from redroll.ops.status import collect_pipeline_status
from redroll.shared.connection import is_cluster
from redroll.shared.keys import Keys
from redroll.shared.streams import text

log = logging.getLogger("redroll.observability.exporter")

ALERT_KINDS = ("out_of_memory", "stream_refusing", "worker_blocked")


def alert_kind(alert: str) -> str:
    """The kind of one of status's alerts (see :func:`redroll.ops.status.collect_alerts`)."""
    if alert.startswith("worker ") and " is blocked" in alert:
        return "worker_blocked"
    if "out of memory:" in alert and "maxmemory" in alert:
        return "out_of_memory"
    return "stream_refusing"


async def collect_memory(r: Redis) -> list[dict[str, Any]]:
    """``INFO memory`` per node: used, max and whether the policy is noeviction ([] if refused)."""
    try:
        info = await r.info("memory")
    except redis.ResponseError:
        return []
    nodes = ({k: v for k, v in info.items() if isinstance(v, dict)} if is_cluster(r) else {"": info})
    return [{"node": node, "used": int(v.get("used_memory") or 0), "max": int(v.get("maxmemory") or 0),
             "noeviction": text(v.get("maxmemory_policy", "")) == "noeviction"} for node, v in sorted(nodes.items())]


async def collect_snapshot(r: Redis, keys: Keys, parts: list[Keys]) -> dict[str, Any]:
    """What one refresh exports: ``status`` (exactly ``redroll status --json``), the desired weights, memory."""
    status = await collect_pipeline_status(r, keys, parts)
    desired = {text(k): text(v) for k, v in (await r.hgetall(keys.weights)).items()}
    return {"status": status, "desired_weights": desired or None, "memory": await collect_memory(r)}


def pipeline_families(snapshot: dict[str, Any]) -> Iterable[Any]:
    """The ``redroll_pipeline_*`` and ``redroll_redis_*`` families of one snapshot."""
    from prometheus_client.core import GaugeMetricFamily

    def gauge(name: str, doc: str, value: float | None = None, labels: list[str] | None = None) -> Any:
        return GaugeMetricFamily(name, doc, value=value, labels=labels)

    status = snapshot["status"]
    req, high = status["requests"], status["requests_high"]
    lanes = status.get("lanes") or {"lanes": 0, "backlog": 0, "pending": 0, "per_lane": []}
    backlog = gauge("redroll_pipeline_backlog", "Entries not yet delivered to a worker, by priority "
                    "(normal, high, lanes): their sum is status's queued_total.", labels=["priority"])
    in_flight = gauge("redroll_pipeline_in_flight", "Entries delivered and not yet acknowledged, by priority.",
                      labels=["priority"])
    for priority, b, p in (("normal", req["backlog"], req["pending"]), ("high", high["backlog"], high["pending"]),
                           ("lanes", lanes["backlog"], lanes.get("pending", 0))):
        backlog.add_metric([priority], b)
        in_flight.add_metric([priority], p)
    yield backlog
    yield in_flight
    for what in ("idle", "age"):
        ms = req[f"oldest_pending_{what}_ms"]
        yield gauge(f"redroll_pipeline_oldest_pending_{what}_seconds",
                    f"The oldest in-flight normal entry's {'idle time' if what == 'idle' else 'age since submit'}.",
                    value=(ms or 0) / 1000.0)
    deliveries = gauge("redroll_pipeline_pending_by_deliveries", "In-flight normal entries by delivery count.",
                       labels=["deliveries"])
    for count, n in req["delivery_histogram"].items():
        deliveries.add_metric([str(count)], n)
    yield deliveries
    if status.get("partitions"):
        fams = {f: gauge(f"redroll_pipeline_partition_{f}", f"Per partition: {doc}.", labels=["partition"])
                for f, doc in (("backlog", "normal entries not yet delivered"), ("in_flight", "entries in flight"),
                               ("dead_letters", "dead letters"))}
        for p in status["partitions"]:
            fams["backlog"].add_metric([p["tag"]], p["queued"])
            fams["in_flight"].add_metric([p["tag"]], p["in_flight"])
            fams["dead_letters"].add_metric([p["tag"]], p["dead_letters"])
        yield from fams.values()
    if lanes["per_lane"]:
        lb = gauge("redroll_pipeline_lane_backlog", "Per affinity lane: entries not yet delivered.",
                   labels=["partition", "lane"])
        lp = gauge("redroll_pipeline_lane_in_flight", "Per affinity lane: entries in flight.",
                   labels=["partition", "lane"])
        for lane in lanes["per_lane"]:
            lb.add_metric([lane["partition"], str(lane["lane"])], lane["backlog"])
            lp.add_metric([lane["partition"], str(lane["lane"])], lane["pending"])
        yield lb
        yield lp
    yield gauge("redroll_pipeline_dead_letters", "Entries in the dead-letter stream(s).", value=status["dead_letters"])
    yield gauge("redroll_pipeline_results", "Records in the results stream(s).", value=status["results"]["length"])
    yield gauge("redroll_pipeline_aborted_ids", "Request ids marked aborted.", value=status["aborted_ids"])
    groups = {f: gauge(f"redroll_pipeline_consumer_group_{f}", doc, labels=["group"])
              for f, doc in (("pending", "Results read by the consumer group, not yet acknowledged."),
                             ("lag", "Results the consumer group has not read yet."),
                             ("consumers", "Consumers in the consumer group."))}
    for g in status["results"]["groups"]:
        groups["pending"].add_metric([g["group"]], g["pending"])
        groups["lag"].add_metric([g["group"]], g["backlog"])
        groups["consumers"].add_metric([g["group"]], g["consumers"])
    yield from groups.values()
    yield gauge("redroll_pipeline_requests_per_second", "Records published per second (live workers, 1 minute).",
                value=status["rates_1m"]["requests_per_s"])
    yield gauge("redroll_pipeline_tokens_per_second", "Output tokens per second (live workers, 1 minute).",
                value=status["rates_1m"]["tokens_per_s"])
    yield gauge("redroll_pipeline_workers_alive", "Workers with a fresh heartbeat.", value=status["workers_alive"])
    yield gauge("redroll_pipeline_workers_stale", "Workers with a stale heartbeat.", value=status["workers_stale"])
    yield from _worker_families(snapshot, gauge)
    alerts = gauge("redroll_pipeline_alerts", "What stops the pipeline now (status's alerts), by kind.",
                   labels=["kind"])
    counts = dict.fromkeys(ALERT_KINDS, 0)
    for a in status["alerts"]:
        counts[alert_kind(a)] += 1
    for kind, n in counts.items():
        alerts.add_metric([kind], n)
    yield alerts
    used = gauge("redroll_redis_memory_used_bytes", "INFO memory used_memory.", labels=["node"])
    limit = gauge("redroll_redis_memory_max_bytes", "maxmemory (0 = no limit).", labels=["node"])
    noevict = gauge("redroll_redis_memory_noeviction", "1 when maxmemory_policy is noeviction.", labels=["node"])
    for m in snapshot["memory"]:
        used.add_metric([m["node"]], m["used"])
        limit.add_metric([m["node"]], m["max"])
        noevict.add_metric([m["node"]], int(m["noeviction"]))
    yield used
    yield limit
    yield noevict


def _worker_families(snapshot: dict[str, Any], gauge: Any) -> Iterable[Any]:
    status = snapshot["status"]
    pending = status["requests"]["pending_per_consumer"]
    by_state: dict[str, int] = {}
    info = gauge("redroll_pipeline_worker_info", "1 per live worker; its host, engine, model, state and weight "
                 "version as labels.", labels=["worker", "host", "engine", "model", "state", "weight_version"])
    fams = {f: gauge(f"redroll_pipeline_worker_{f}", doc, labels=["worker"])
            for f, doc in (("in_flight", "Requests the live worker generates now."),
                           ("capacity", "The live worker's max_inflight."),
                           ("pending", "Normal entries XPENDING holds for the live worker."),
                           ("tokens_per_second", "The live worker's output tokens per second (1 minute)."),
                           ("heartbeat_age_seconds", "Seconds since the worker's last heartbeat."))}
    desired = (snapshot.get("desired_weights") or {}).get("weight_version")
    old = 0
    for w in status["workers"]:
        name = w["name"]
        fams["heartbeat_age_seconds"].add_metric([name], w["age_s"])
        if not w["alive"]:
            by_state["stale"] = by_state.get("stale", 0) + 1
            continue
        state = str(w.get("state") or "unknown")
        by_state[state] = by_state.get(state, 0) + 1
        version = "" if w.get("weight_version") is None else str(w["weight_version"])
        info.add_metric([name, str(w.get("host") or ""), str(w.get("engine") or ""), str(w.get("model") or ""),
                         state, version], 1)
        fams["in_flight"].add_metric([name], w.get("inflight") or 0)
        fams["capacity"].add_metric([name], w.get("max_inflight") or 0)
        fams["pending"].add_metric([name], pending.get(name, 0))
        fams["tokens_per_second"].add_metric([name], w.get("tokens_per_s_1m") or 0.0)
        if desired is not None and version != desired:
            old += 1
    states = gauge("redroll_pipeline_workers", "Workers by state (live ones by their heartbeat's state, stale "
                   "ones as stale).", labels=["state"])
    for state in sorted(set(by_state) | {"running", "stale"}):
        states.add_metric([state], by_state.get(state, 0))
    yield states
    yield info
    yield from fams.values()
    if desired is not None:
        d = gauge("redroll_pipeline_desired_weight_version_info", "1: the weight version set by redroll weights "
                  "update.", labels=["weight_version", "model_path"])
        d.add_metric([desired, snapshot["desired_weights"].get("model_path", "")], 1)
        yield d
    yield gauge("redroll_pipeline_workers_on_old_weights", "Live workers serving another weight version than "
                "the desired one (0 when none is desired).", value=old)


class PipelineMetrics:
    """A registry whose collector reads the latest snapshot (see the module docstring)."""

    def __init__(self) -> None:
        from redroll.observability.metrics import _require, _StatsCollector

        pc = _require()
        self.registry = pc.CollectorRegistry()
        self.snapshot: dict[str, Any] | None = None
        self.last_success: float | None = None
        self.snapshot_seconds = 0.0
        self.errors = 0
        self._last_error: str | None = None
        self.registry.register(_StatsCollector(self._families))

    async def refresh(self, r: Redis, keys: Keys, parts: list[Keys]) -> bool:
        """Take a snapshot; on a Redis or network error, drop the pipeline figures (up = 0) and say why once."""
        t0 = time.monotonic()
        try:
            snapshot = await collect_snapshot(r, keys, parts)
        except (redis.RedisError, OSError) as exc:
            self.snapshot, self.errors = None, self.errors + 1
            if str(exc) != self._last_error:
                log.warning("pipeline snapshot failed: %s", exc)
            self._last_error = str(exc)
            return False
        finally:
            self.snapshot_seconds = time.monotonic() - t0
        self.snapshot, self.last_success, self._last_error = snapshot, time.time(), None
        return True

    def _families(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snapshot = self.snapshot  # one reference: a refresh in between swaps it whole
        yield GaugeMetricFamily("redroll_exporter_up", "1 when the last snapshot succeeded.",
                                value=int(snapshot is not None))
        yield GaugeMetricFamily("redroll_exporter_last_success_timestamp_seconds",
                                "When the last snapshot succeeded (unix time, 0 = never).", value=self.last_success or 0)
        yield GaugeMetricFamily("redroll_exporter_snapshot_seconds", "How long the last snapshot took.",
                                value=self.snapshot_seconds)
        yield CounterMetricFamily("redroll_exporter_snapshot_errors", "Snapshots that failed.", value=self.errors)
        if snapshot is not None:
            yield from pipeline_families(snapshot)


async def run_exporter(r: Redis, keys: Keys, parts: list[Keys], port: int, interval: float,
                       addr: str = "127.0.0.1") -> None:
    """Serve ``/metrics`` on ``addr:port`` and refresh the snapshot every ``interval`` seconds, until cancelled."""
    from redroll.observability.metrics import serve

    metrics = PipelineMetrics()
    await metrics.refresh(r, keys, parts)  # the first scrape already has figures
    server = serve(metrics, port, addr=addr)
    log.info("pipeline exporter on %s:%d/metrics, namespace %r, every %.1f s", addr, server.server_port,
             keys.namespace, interval)
    try:
        while True:
            await asyncio.sleep(interval)
            await metrics.refresh(r, keys, parts)
    finally:
        server.shutdown()
