"""Periodic housekeeping run by every worker (see ``redroll gc``)."""

from __future__ import annotations

import logging

from redroll.shared.gc import collect_garbage

from .context import WorkerContext

log = logging.getLogger("redroll.worker")


async def housekeeping_loop(ctx: WorkerContext) -> None:
    """Every ``gc_interval_s``: expired reply streams, gone workers, empty consumers."""
    while not ctx.stopping.is_set():
        await ctx.pause(ctx.settings.gc_interval_s)
        if ctx.stopping.is_set():
            return
        report = await collect_garbage(ctx.redis, ctx.keys, reply_ttl_s=ctx.settings.reply_ttl_s,
                                       partitions=ctx.parts)
        if report.total:
            log.info("housekeeping removed %s", report.to_json())
