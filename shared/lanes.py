"""The one setting every process of a pipeline must agree on: the number of affinity lanes.

Producers place a keyed request on lane ``lane_index(key, L)``; workers read lanes ``0..L-1``. A
process with another L would queue entries on lanes nobody reads, or read the wrong ones, so L is
published in the pipeline's ``{ns}:config`` hash by the first process that uses lanes, and a process
whose L differs refuses to start. ``redroll lanes set N`` changes it (only while no entry is left
in a lane that would no longer exist, or be read by another name: see the README).
"""

from __future__ import annotations

import json
import time

import redis
from redis.asyncio import Redis

from redroll.shared.errors import RedrollError
from redroll.shared.keys import WORKERS_GROUP, Keys
from redroll.shared.streams import text

FIELD = "affinity_lanes"


class LanesMismatchError(RedrollError, RuntimeError):
    """This process's ``affinity_lanes`` differs from the pipeline's."""


async def pipeline_lanes(r: Redis, keys: Keys) -> int | None:
    raw = await r.hget(keys.config, FIELD)
    return int(text(raw)) if raw is not None else None


async def agree_on_lanes(r: Redis, keys: Keys, lanes: int) -> None:
    """Publish ``lanes`` if the pipeline has no setting yet (0 publishes nothing: the plain
    layout is left exactly as it is), else check it; raises :class:`LanesMismatchError`."""
    if lanes:
        await r.hsetnx(keys.config, FIELD, lanes)
    published = await pipeline_lanes(r, keys)
    if (published or 0) != lanes:
        raise LanesMismatchError(
            f"this pipeline ({keys.namespace}) runs with affinity_lanes={published or 0} ({keys.config}), this "
            f"process with {lanes}: set REDROLL_AFFINITY_LANES / --affinity-lanes to {published or 0}, or change "
            "the pipeline's with `redroll lanes set N` (see the README)")


async def stream_backlog(r: Redis, stream: str) -> list[dict]:
    """``[{length, pending, backlog}]`` of group ``workers`` on ``stream`` (empty when it has no
    entries). Entries are deleted once finished, so length - pending is what waits when Redis
    cannot say (its lag is unknown after deletions)."""
    length = await r.xlen(stream)
    if not length:
        return []
    pending = backlog = 0
    try:
        groups = await r.xinfo_groups(stream)
    except redis.ResponseError:  # no such key (deleted meanwhile) or another type
        return []
    for g in groups:
        if text(g.get("name")) == WORKERS_GROUP:
            pending = int(g.get("pending") or 0)
            lag = g.get("lag")
            backlog = int(lag) if lag is not None else max(0, length - pending)
            break
    else:
        backlog = length
    return [{"length": length, "pending": pending, "backlog": backlog}]


async def lane_backlog(r: Redis, parts: list[Keys], lanes: int) -> list[dict]:
    """Per partition and lane: length, pending and backlog (entries not yet delivered) of group ``workers``."""
    out = []
    for part in parts:
        for j in range(lanes):
            stream = part.lane(j)
            row = (await stream_backlog(r, stream) or [{"length": 0, "pending": 0, "backlog": 0}])[0]
            out.append({"partition": part.tag, "lane": j, "stream": stream, **row})
    return out


async def set_lanes(r: Redis, keys: Keys, parts: list[Keys], lanes: int, *, force: bool = False) -> int:
    """Change the pipeline's number of lanes; refused (ValueError) while any lane of the current
    layout holds an entry (it would be stranded or read under another lane's owner), unless ``force``."""
    if lanes < 0:
        raise ValueError("affinity_lanes must be 0 (off) or more")
    current = await pipeline_lanes(r, keys) or 0
    if not force and current:
        busy = [b for b in await lane_backlog(r, [p.__class__(p.namespace, p.partition, current) for p in parts],
                                              current) if b["length"]]
        if busy:
            raise ValueError(f"{len(busy)} lane(s) still hold entries ({busy[0]['stream']}: {busy[0]['length']}); "
                             "let the workers empty them (stop the producers first), or pass --force")
    if lanes:
        await r.hset(keys.config, FIELD, lanes)
    else:
        await r.hdel(keys.config, FIELD)
    return current


async def lane_report(r: Redis, keys: Keys, parts: list[Keys], *, stale_after_s: float = 10.0) -> dict:
    """The pipeline's lanes as ``redroll lanes show`` and ``status`` print them: L, per lane its
    backlog, in-flight count and owner(s) (from the live workers' heartbeats: two owners for one
    lane means the workers saw different heartbeats for a beat, which costs only affinity)."""
    lanes = await pipeline_lanes(r, keys) or 0
    if not lanes:
        return {"lanes": 0, "backlog": 0, "per_lane": []}
    now = time.time()
    owners: dict[int, list[str]] = {}
    for name, raw in (await r.hgetall(keys.workers)).items():
        try:
            beat = json.loads(raw)
        except ValueError:
            continue
        if now - float(beat.get("seen", 0)) > stale_after_s:
            continue
        for j in beat.get("lanes") or []:
            owners.setdefault(int(j), []).append(text(name))
    per_lane = await lane_backlog(r, [p.__class__(p.namespace, p.partition, lanes) for p in parts], lanes)
    for lane in per_lane:
        found = sorted(owners.get(lane["lane"], []))
        lane["owner"] = ", ".join(found) if found else None
    return {"lanes": lanes, "backlog": sum(x["backlog"] for x in per_lane),
            "pending": sum(x["pending"] for x in per_lane), "per_lane": per_lane}
