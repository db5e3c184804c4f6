"""Bounded memory: trim a result stream only below what every consumer group has acked."""

from __future__ import annotations

from redis.asyncio import Redis

from redroll.shared.streams import id_tuple, text


def _next_id(entry_id: str) -> str:
    ms, seq = id_tuple(entry_id)
    return f"{ms}-{seq + 1}"


async def safe_trim_id(r: Redis, stream: str) -> str | None:
    """The smallest id some group still needs (oldest pending, or the first undelivered entry).

    None when the stream has no consumer group (then nothing is known to be acked).
    """
    groups = await r.xinfo_groups(stream)
    if not groups:
        return None
    candidates: list[str] = []
    for g in groups:
        name = text(g["name"])
        summary = await r.xpending(stream, name) if int(g["pending"]) > 0 else None
        if summary and summary.get("min") is not None:
            candidates.append(text(summary["min"]))
        else:  # nothing pending (or it was all acked since XINFO): everything delivered is acked
            candidates.append(_next_id(text(g["last-delivered-id"])))
    return min(candidates, key=id_tuple)


async def trim_acked(r: Redis, stream: str) -> int:
    """XTRIM MINID to the safe id; returns how many entries were removed."""
    try:
        safe = await safe_trim_id(r, stream)
    except Exception as exc:  # no such stream yet
        if "no such key" in str(exc).lower():
            return 0
        raise
    if safe is None:
        return 0
    return int(await r.xtrim(stream, minid=safe, approximate=False))
