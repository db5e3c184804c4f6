"""What the pipeline is doing, from Redis alone: depth, backlog, pending, workers, dead letters."""

from __future__ import annotations

import json
import time
from typing import Any

import redis
from redis.asyncio import Redis

from redroll.shared.connection import is_cluster
from redroll.shared.keys import WORKERS_GROUP, Keys
from redroll.shared.lanes import lane_report, pipeline_lanes
from redroll.shared.streams import id_tuple, text

STALE_AFTER_S = 10.0
"""A worker whose heartbeat is older than this is reported stale."""

LAST_POSSIBLE_ID = "18446744073709551615-18446744073709551615"


async def stream_problem(r: Redis, key: str) -> str | None:
    """Why ``key`` cannot take new entries (a key of another type, exhausted ids), or None."""
    try:
        kind = text(await r.type(key))
        if kind == "none":
            return None
        if kind != "stream":
            return f"{key} is a {kind}, not a stream: every write to it is refused (WRONGTYPE)"
        info = await r.xinfo_stream(key)
    except redis.ResponseError as exc:
        return f"{key}: {exc}"
    if text(info.get("last-generated-id", "")) == LAST_POSSIBLE_ID:
        return f"{key} has exhausted the last possible id: it refuses every new entry (redroll repair {key})"
    return None


async def memory_problem(r: Redis) -> str | None:
    """Out of memory with noeviction: Redis refuses every write that grows memory (XADD, SET, ...)."""
    try:
        info = await r.info("memory")
    except redis.ResponseError:
        return None
    if is_cluster(r):  # one answer per node
        problems = [_memory_line(v, f"{k}: ") for k, v in info.items() if isinstance(v, dict)]
        return "; ".join(x for x in problems if x) or None
    return _memory_line(info)


def _memory_line(info: dict[str, Any], where: str = "") -> str | None:
    limit = int(info.get("maxmemory") or 0)
    used = int(info.get("used_memory") or 0)
    policy = text(info.get("maxmemory_policy", ""))
    if limit and used > limit and policy == "noeviction":
        return (f"{where}out of memory: {used} bytes used of maxmemory {limit} (noeviction): Redis refuses "
                "XADD, SET, SADD, HSET; workers hold their records, consumers their acks, until memory frees")
    return None


async def collect_alerts(r: Redis, keys: Keys, parts: list[Keys], workers: list[dict[str, Any]]) -> list[str]:
    """What stops the pipeline now: memory, streams that refuse entries, workers that are blocked."""
    alerts = []
    problem = await memory_problem(r)
    if problem:
        alerts.append(problem)
    streams = [keys.control] + [k for part in parts for k in (part.requests, part.requests_high, part.results,
                                                               part.dead)]
    for key in dict.fromkeys(streams):
        problem = await stream_problem(r, key)
        if problem:
            alerts.append(problem)
    for w in workers:
        if w.get("alive") and w.get("state") == "blocked":
            refused = "; ".join(f"{k}: {v}" for k, v in (w.get("blocked") or {}).items())
            alerts.append(f"worker {w['name']} is blocked (claiming paused, output held): {refused or '?'}")
    return alerts


async def _groups(r: Redis, stream: str, length: int) -> list[dict[str, Any]]:
    try:
        raw = await r.xinfo_groups(stream)
    except redis.ResponseError:
        return []
    now_ms = time.time() * 1000
    out = []
    for g in raw:
        name = text(g["name"])
        pending = int(g["pending"])
        lag = g.get("lag")
        # XINFO lag is nil once undelivered entries were deleted; processed entries are deleted,
        # so what is in the stream and not pending is the backlog.
        backlog = int(lag) if lag is not None else max(0, length - pending)
        oldest_idle_ms = oldest_age_ms = None
        if pending:
            first = await r.xpending_range(stream, name, min="-", max="+", count=1)
            if first:
                oldest_idle_ms = int(first[0]["time_since_delivered"])
                oldest_age_ms = int(now_ms - id_tuple(text(first[0]["message_id"]))[0])
        out.append({
            "group": name,
            "consumers": int(g["consumers"]),
            "pending": pending,
            "backlog": backlog,
            "lag": int(lag) if lag is not None else None,
            "last_delivered_id": text(g["last-delivered-id"]),
            "oldest_pending_idle_ms": oldest_idle_ms,
            "oldest_pending_age_ms": oldest_age_ms,
        })
    return out


async def _pending_detail(r: Redis, stream: str, group: str, sample: int = 10_000) -> dict[str, Any]:
    """Pending entries per consumer and a histogram of their delivery counts."""
    try:
        summary = await r.xpending(stream, group)
    except redis.ResponseError:
        return {"per_consumer": {}, "delivery_histogram": {}}
    per_consumer = {text(c["name"]): int(c["pending"]) for c in summary.get("consumers") or []}
    histogram: dict[str, int] = {}
    if int(summary.get("pending") or 0):
        for entry in await r.xpending_range(stream, group, min="-", max="+", count=sample):
            key = str(int(entry["times_delivered"]))
            histogram[key] = histogram.get(key, 0) + 1
    return {"per_consumer": per_consumer, "delivery_histogram": dict(sorted(histogram.items(), key=lambda kv: int(kv[0])))}


async def collect_status(r: Redis, keys: Keys) -> dict[str, Any]:
    """A stable JSON-able snapshot of one pipeline."""
    async with r.pipeline(transaction=False) as pipe:
        pipe.xlen(keys.requests)
        pipe.xlen(keys.results)
        pipe.xlen(keys.dead)
        pipe.hgetall(keys.workers)
        pipe.zcard(keys.aborted)
        req_len, res_len, dead_len, beats, aborted = await pipe.execute()
    req_groups = await _groups(r, keys.requests, req_len)
    high_len = await r.xlen(keys.requests_high)
    high_group = next((g for g in await _groups(r, keys.requests_high, high_len) if g["group"] == WORKERS_GROUP), None)
    res_groups = await _groups(r, keys.results, res_len)
    workers_group = next((g for g in req_groups if g["group"] == WORKERS_GROUP), None)
    detail = await _pending_detail(r, keys.requests, WORKERS_GROUP)
    now = time.time()
    workers = []
    for name, raw in sorted(beats.items()):
        try:
            beat = json.loads(raw)
        except ValueError:
            beat = {}
        seen = float(beat.get("seen", 0))
        beat.update(name=text(name), age_s=round(now - seen, 3), alive=(now - seen) <= STALE_AFTER_S)
        workers.append(beat)
    warnings = []
    if res_len and not res_groups:
        warnings.append(f"{keys.results} has {res_len} records and no consumer group: nothing trims it "
                        "below the safety cap")
    return {
        "namespace": keys.namespace,
        "time": round(now, 3),
        "alerts": await collect_alerts(r, keys, [keys], workers),
        "requests": {
            "stream": keys.requests,
            "length": req_len,
            "pending": workers_group["pending"] if workers_group else 0,
            "backlog": workers_group["backlog"] if workers_group else req_len,
            "oldest_pending_idle_ms": workers_group["oldest_pending_idle_ms"] if workers_group else None,
            "oldest_pending_age_ms": workers_group["oldest_pending_age_ms"] if workers_group else None,
            "pending_per_consumer": detail["per_consumer"],
            "delivery_histogram": detail["delivery_histogram"],
            "groups": req_groups,
        },
        "rates_1m": {
            "requests_per_s": round(sum(w.get("requests_per_s_1m", 0.0) for w in workers if w["alive"]), 3),
            "tokens_per_s": round(sum(w.get("tokens_per_s_1m", 0.0) for w in workers if w["alive"]), 3),
        },
        "requests_high": {
            "stream": keys.requests_high,
            "length": high_len,
            "pending": high_group["pending"] if high_group else 0,
            "backlog": high_group["backlog"] if high_group else high_len,
        },
        "results": {"stream": keys.results, "length": res_len, "groups": res_groups},
        "dead_letters": dead_len,
        "aborted_ids": aborted,
        "workers": workers,
        "workers_alive": sum(1 for w in workers if w["alive"]),
        "workers_stale": sum(1 for w in workers if not w["alive"]),
        "warnings": warnings,
    }


async def collect_pipeline_status(r: Redis, keys: Keys, parts: list[Keys]) -> dict[str, Any]:
    """:func:`collect_status` summed over the partitions of a partitioned pipeline (one partition:
    exactly :func:`collect_status`), plus the affinity lanes when the pipeline has them (their
    backlog and owners; ``queued_total`` sums every request stream). Workers and aborts are
    pipeline-wide; queues are per partition."""
    lanes = await pipeline_lanes(r, keys) or 0
    parts = [Keys(p.namespace, p.partition, lanes) for p in parts]
    status = await _collect_partitions(r, keys, parts)
    if lanes:
        report = await lane_report(r, keys, parts, stale_after_s=STALE_AFTER_S)
        status["lanes"] = report
        status["alerts"] += [a for part in parts for stream in part.lane_streams
                             if (a := await stream_problem(r, stream))]
    status["queued_total"] = (status["requests"]["backlog"] + status["requests_high"]["backlog"]
                              + (status["lanes"]["backlog"] if lanes else 0))
    if status["queued_total"] and not status["workers_alive"]:  # (a namespace typo, or a fleet down)
        status["warnings"].append(f"{status['queued_total']} request(s) queued and no live worker in namespace "
                                  f"{keys.namespace!r}: nothing will run them until a worker starts")
    return status


async def _collect_partitions(r: Redis, keys: Keys, parts: list[Keys]) -> dict[str, Any]:
    if len(parts) == 1:
        return await collect_status(r, parts[0])
    overall = await collect_status(r, keys)  # workers, aborts, rates
    per_part = [await collect_status(r, part) for part in parts]
    req = overall["requests"]
    req.update(stream=[p["requests"]["stream"] for p in per_part], groups=[])
    for name in ("length", "pending", "backlog"):
        req[name] = sum(p["requests"][name] for p in per_part)
        overall["requests_high"][name] = sum(p["requests_high"][name] for p in per_part)
    overall["requests_high"]["stream"] = [p["requests_high"]["stream"] for p in per_part]
    for name in ("oldest_pending_idle_ms", "oldest_pending_age_ms"):
        values = [p["requests"][name] for p in per_part if p["requests"][name] is not None]
        req[name] = max(values) if values else None
    req["pending_per_consumer"], req["delivery_histogram"] = {}, {}
    for p in per_part:
        for field in ("pending_per_consumer", "delivery_histogram"):
            for k, v in p["requests"][field].items():
                req[field][k] = req[field].get(k, 0) + v
        req["groups"] += p["requests"]["groups"]
    req["delivery_histogram"] = dict(sorted(req["delivery_histogram"].items(), key=lambda kv: int(kv[0])))
    groups: dict[str, dict[str, Any]] = {}
    for p in per_part:
        for g in p["results"]["groups"]:
            agg = groups.setdefault(g["group"], {"group": g["group"], "consumers": 0, "pending": 0, "backlog": 0})
            for field in ("consumers", "pending", "backlog"):
                agg[field] += g[field]
    overall["results"] = {"stream": [p["results"]["stream"] for p in per_part],
                          "length": sum(p["results"]["length"] for p in per_part), "groups": list(groups.values())}
    overall["dead_letters"] = sum(p["dead_letters"] for p in per_part)
    overall["warnings"] = [w for p in per_part for w in p["warnings"]]
    overall["alerts"] = await collect_alerts(r, keys, parts, overall["workers"])
    overall["partitions"] = [{"tag": part.tag, "node": _node_of(r, part.requests), "queued": p["requests"]["backlog"],
                              "in_flight": p["requests"]["pending"], "results": p["results"]["length"],
                              "dead_letters": p["dead_letters"]}
                             for part, p in zip(parts, per_part)]
    return overall


def _node_of(r: Redis, key: str) -> str | None:
    """host:port of the cluster primary holding ``key`` (None on a single server)."""
    if not is_cluster(r):
        return None
    node = r.get_node_from_key(key)  # type: ignore[attr-defined]
    return f"{node.host}:{node.port}" if node is not None else None


def render_status(status: dict[str, Any]) -> Any:
    """A rich renderable for a terminal."""
    from rich.console import Group
    from rich.table import Table

    req = status["requests"]
    summary = Table(title=f"redroll pipeline '{status['namespace']}'", show_header=False)
    summary.add_row("queued (backlog)", str(req["backlog"]))
    lanes = status.get("lanes")
    if lanes:
        summary.add_row(f"queued in {lanes['lanes']} affinity lanes", str(lanes["backlog"]))
    if status["requests_high"]["length"]:
        summary.add_row("queued high priority", str(status["requests_high"]["backlog"]))
    summary.add_row("in flight (pending)", str(req["pending"]))
    summary.add_row("oldest pending idle", f"{req['oldest_pending_idle_ms']} ms" if req["oldest_pending_idle_ms"] is not None else "-")
    summary.add_row("results stream length", str(status["results"]["length"]))
    summary.add_row("dead letters", str(status["dead_letters"]))
    summary.add_row("workers alive / stale", f"{status['workers_alive']} / {status['workers_stale']}")
    summary.add_row("requests/s, tokens/s (1 min)",
                    f"{status['rates_1m']['requests_per_s']:.1f}, {status['rates_1m']['tokens_per_s']:.1f}")
    if req["delivery_histogram"]:
        summary.add_row("pending by delivery count",
                        ", ".join(f"{k}x: {v}" for k, v in req["delivery_histogram"].items()))
    workers = Table(title="workers")
    for col in ("name", "state", "engine", "model", "weight", "inflight", "pending", "published", "tok/s", "age s"):
        workers.add_column(col)
    for w in status["workers"]:
        workers.add_row(w["name"], w.get("state", "?") if w["alive"] else "STALE", str(w.get("engine")),
                        str(w.get("model")), str(w.get("weight_version")), str(w.get("inflight")),
                        str(req["pending_per_consumer"].get(w["name"], 0)), str(w.get("published")),
                        f"{w.get('tokens_per_s_1m', 0.0):.1f}", str(w["age_s"]))
    groups = Table(title="result consumer groups")
    for col in ("group", "consumers", "pending", "backlog"):
        groups.add_column(col)
    for g in status["results"]["groups"]:
        groups.add_row(g["group"], str(g["consumers"]), str(g["pending"]), str(g["backlog"]))
    parts: list[Any] = [summary, workers, groups]
    if status.get("partitions"):
        table = Table(title="partitions")
        for col in ("tag", "node", "queued", "in flight", "results", "dead letters"):
            table.add_column(col)
        for p in status["partitions"]:
            table.add_row(p["tag"], p.get("node") or "-", str(p["queued"]), str(p["in_flight"]), str(p["results"]),
                          str(p["dead_letters"]))
        parts.append(table)
    if lanes:
        table = Table(title="affinity lanes")
        for col in ("stream", "queued", "in flight", "owner"):
            table.add_column(col)
        for lane in lanes["per_lane"]:
            table.add_row(lane["stream"], str(lane["backlog"]), str(lane["pending"]), lane["owner"] or "-")
        parts.append(table)
    parts += [f"[bold red]alert:[/] {a}" for a in status.get("alerts", [])]
    parts += [f"[yellow]warning:[/] {w}" for w in status["warnings"]]
    return Group(*parts)
