"""``redroll trace REQUEST_ID``: the life of one request (:mod:`redroll.ops.trace` reads and draws it)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from redroll.cli.options import add_connection_options, settings_from_args


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``redroll trace`` on the command line's sub-parsers."""
    p = sub.add_parser("trace", help="the life of one request: submit, deliveries, checkpoints, record, dead "
                                     "letters, consumer groups (from its event log and what Redis holds)")
    add_connection_options(p)
    p.add_argument("request_id", help="the request's request_id")
    p.add_argument("--json", action="store_true", help="the timeline as JSON (the dashboard's form)")
    p.set_defaults(run=run)
    return p


async def run(args: argparse.Namespace) -> int:
    """Print the timeline; exit status 1 when Redis holds nothing of the request."""
    import msgspec
    from rich.console import Console

    from redroll.ops.trace import render_timeline, request_timeline
    from redroll.shared.connection import connect

    settings = settings_from_args(args)
    async with connect(settings) as r:
        timeline = await request_timeline(r, settings.partition_keys, args.request_id,
                                          dedup_window_s=settings.dedup_window_s)
    if args.json:
        sys.stdout.write(msgspec.json.encode(timeline.to_builtins()).decode() + "\n")
    else:
        Console().print(render_timeline(timeline))
    return 0 if timeline.log_found or timeline.now.queued_entry else 1
