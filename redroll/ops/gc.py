"""Housekeeping: reply streams of producers that never came back, stale heartbeats, idle empty consumers,
rid keys whose request is gone (cancelled while queued), orphaned checkpoints.

Run by ``redroll gc`` and periodically by workers. Never removes a consumer that owns pending
entries (XGROUP DELCONSUMER would drop them).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import redis
from redis.asyncio import Redis

from redroll.shared.keys import WORKERS_GROUP, Keys, parts_key_for
from redroll.shared.lanes import pipeline_lanes
from redroll.shared.scripts import Scripts
from redroll.shared.streams import id_tuple, text
from redroll.shared.tally import Tally


@dataclass
class GcReport(Tally):
    """What a collection deleted (or, dry, would delete), by kind."""

    reply_streams: list[str] = field(default_factory=list)
    """Reply streams without a TTL whose producer has been gone longer than ``reply_ttl_s``."""
    heartbeats: list[str] = field(default_factory=list)
    """Heartbeats of workers that stopped beating."""
    consumers: list[str] = field(default_factory=list)
    """Workers' group consumers with nothing pending, idle longer than ``idle_consumer_s`` (with each,
    its checkpoint parts stream in that partition)."""
    checkpoints: list[str] = field(default_factory=list)
    """Checkpoints whose request is gone (no submit de-duplication key names it)."""
    rid_keys: list[str] = field(default_factory=list)
    """Submit de-duplication keys whose entry is gone (a request cancelled while queued)."""

    def to_json(self) -> dict:
        return self.by_name()


async def _reply_stream_idle_s(r: Redis, key: str, now: float) -> float | None:
    """Seconds since anything happened on a reply stream (last entry or its producer's last read)."""
    try:
        info = await r.xinfo_stream(key)
    except redis.ResponseError:
        return None
    last_ms = id_tuple(text(info["last-generated-id"]))[0]
    newest = last_ms / 1000.0
    try:
        for group in await r.xinfo_groups(key):
            for consumer in await r.xinfo_consumers(key, text(group["name"])):
                newest = max(newest, now - int(consumer["idle"]) / 1000.0)
    except redis.ResponseError:
        pass
    return now - newest


async def collect_garbage(r: Redis, keys: Keys, *, reply_ttl_s: float, stale_worker_s: float = 3600.0,
                          idle_consumer_s: float = 3600.0, dry_run: bool = False,
                          partitions: list[Keys] | None = None, rid_keys: bool = True) -> GcReport:
    """``keys``: the pipeline-wide keys (heartbeats); ``partitions``: the per-request key sets
    (reply streams, request streams), default ``[keys]``. ``rid_keys``: also sweep the rid keys
    (one check per queued or in-flight request: workers share it out, see
    ``engine_worker/housekeeping.py``)."""
    report = GcReport()
    now = time.time()
    lanes = await pipeline_lanes(r, keys) or 0
    parts = [Keys(p.namespace, p.partition, lanes) for p in (partitions or [keys])]
    for part in parts:
        await _collect_reply_streams(r, part, reply_ttl_s, now, dry_run, report)
        if rid_keys:
            await _collect_rid_keys(r, part, dry_run, report)
        await _collect_checkpoints(r, part, dry_run, report)
    await _collect_heartbeats(r, keys, stale_worker_s, now, dry_run, report)
    for part in parts:
        for stream in part.request_streams:
            await _collect_consumers(r, stream, idle_consumer_s, dry_run, report)
    return report


RID_BATCH = 500
"""Rid keys checked per function call."""


async def _collect_rid_keys(r: Redis, keys: Keys, dry_run: bool, report: GcReport) -> None:
    """Rid keys whose entry is in none of the request streams (release_rids.lua checks and deletes
    each atomically). The finish and a dead letter delete their rid key; a request cancelled while
    queued leaves it, because producers may not delete rid keys (docs/acl.md)."""
    streams = keys.request_streams
    batch: list[str] = []
    async for raw in r.scan_iter(match=keys.rid("") + "*", count=RID_BATCH, _type="string"):
        batch.append(text(raw))
        if len(batch) >= RID_BATCH:
            report.rid_keys += await Scripts(r).release_rids(streams, batch, dry_run=dry_run)
            batch = []
    report.rid_keys += await Scripts(r).release_rids(streams, batch, dry_run=dry_run)


async def _collect_checkpoints(r: Redis, keys: Keys, dry_run: bool, report: GcReport) -> None:
    """Checkpoints of resumable requests that are gone: no submit de-duplication key any more (the
    finish deletes both; a key left behind is a request that ended some other way, or expired)."""
    prefix = keys.partial("")
    async for raw in r.scan_iter(match=prefix + "*", count=500, _type="string"):
        key = text(raw)
        if await r.exists(keys.rid(key[len(prefix):])):
            continue
        report.checkpoints.append(key)
        if not dry_run:
            await r.delete(key)


async def _collect_reply_streams(r: Redis, keys: Keys, reply_ttl_s: float, now: float, dry_run: bool,
                                 report: GcReport) -> None:
    """Reply streams idle past their TTL with no expiry set (a worker re-created an expired one)."""
    async for raw in r.scan_iter(match=keys.reply_prefix + "*", count=500, _type="stream"):
        key = text(raw)
        if await r.ttl(key) != -1:
            continue  # it still has its TTL: it will expire on its own
        idle = await _reply_stream_idle_s(r, key, now)
        if idle is not None and idle > reply_ttl_s:
            report.reply_streams.append(key)
            if not dry_run:
                await r.delete(key)


async def _collect_heartbeats(r: Redis, keys: Keys, stale_worker_s: float, now: float, dry_run: bool,
                              report: GcReport) -> None:
    """Heartbeats of workers gone for a long time (a SIGKILLed worker cannot deregister)."""
    for name, beat in (await r.hgetall(keys.workers)).items():
        try:
            seen = float(json.loads(beat).get("seen", 0))
        except (ValueError, AttributeError):
            seen = 0.0
        if now - seen > stale_worker_s:
            report.heartbeats.append(text(name))
            if not dry_run:
                await r.hdel(keys.workers, name)


async def _collect_consumers(r: Redis, stream: str, idle_consumer_s: float, dry_run: bool,
                             report: GcReport) -> None:
    """Consumers of the workers group with nothing pending and idle for long, and their checkpoint
    parts streams (``Keys.parts``)."""
    try:
        consumers = await r.xinfo_consumers(stream, WORKERS_GROUP)
    except redis.ResponseError:
        return
    for c in consumers:
        if int(c["pending"]) == 0 and int(c["idle"]) / 1000.0 > idle_consumer_s:
            name = text(c["name"])
            if not dry_run:
                if await Scripts(r).delete_consumer_if_empty(stream, WORKERS_GROUP, name) < 0:
                    continue  # atomic re-check: a consumer that gained pending entries meanwhile is kept
                # (its checkpoint parts too: whoever took its entries consolidated them long since)
                await r.delete(parts_key_for(stream, name))
            if name not in report.consumers:
                report.consumers.append(name)

