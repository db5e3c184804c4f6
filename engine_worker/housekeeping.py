"""Periodic housekeeping run by every worker (see ``redroll gc``)."""

from __future__ import annotations

import logging
import random

from redroll.engine_worker.context import WorkerContext
from redroll.ops.control import live_workers
from redroll.ops.gc import collect_garbage

log = logging.getLogger("redroll.worker")


def sweep_share(live: int) -> float:
    """The chance that one worker's round sweeps the rid keys: 1 / live workers, so that the fleet
    sweeps about once per ``gc_interval_s`` whatever its size (the sweep reads every rid key: one
    per queued or in-flight request)."""
    return 1.0 / max(1, live)


async def housekeeping_loop(ctx: WorkerContext, rng: random.Random | None = None) -> None:
    """Every ``gc_interval_s``: expired reply streams, gone workers, empty consumers, orphaned
    checkpoints; and, in about one worker's round per interval, rid keys whose request is gone."""
    rng = rng or random.Random()
    while not ctx.stopping.is_set():
        await ctx.pause(ctx.settings.gc_interval_s)
        if ctx.stopping.is_set():
            return
        live = len(await live_workers(ctx.redis, ctx.keys))
        report = await collect_garbage(ctx.redis, ctx.keys, reply_ttl_s=ctx.settings.reply_ttl_s,
                                       partitions=ctx.parts, rid_keys=rng.random() < sweep_share(live))
        if report.total:
            log.info("housekeeping removed %s", report.to_json())
