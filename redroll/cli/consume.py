"""``redroll consume``: apply callbacks to records through a consumer group."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from redroll.cli.burst import add_burst_flag
from redroll.cli.options import (
    add_connection_options,
    add_delivery_flags,
    add_metrics_flags,
    positive_int,
    settings_from_args,
)
from redroll.cli.process import serve


def add_parser(sub: Any) -> None:
    p = sub.add_parser("consume", help="apply callbacks to records through a consumer group")
    add_connection_options(p)
    p.add_argument("--group", required=True, help="the consumer group (each group sees every record once)")
    p.add_argument("--handler", action="append", default=[], metavar="NAME=module:function",
                   help="register a handler (repeatable); records select one by their callback name")
    p.add_argument("--default-handler", default=None, metavar="module:function",
                   help="handler for records that name no callback")
    p.add_argument("--stream", default=None, help="reply stream to consume (default {ns}:results)")
    add_delivery_flags(p, "record", "another consumer of the group")
    p.add_argument("--batch", type=int, default=128,
                   help="most records per read (fewer after large ones: see --batch-bytes)")
    p.add_argument("--batch-bytes", type=positive_int, default=1 << 20,
                   help="record data per read and per applied chunk (default 1 MiB, at least one record): "
                        "async handlers run concurrently within a chunk")
    add_metrics_flags(p)
    add_burst_flag(p, "consume")
    p.set_defaults(run=run)


async def run(args: argparse.Namespace) -> int:
    from redroll.consumer.handlers import load_handler, parse_handler_flag
    from redroll.consumer.runner import ConsumerRunner

    settings = settings_from_args(args, claim_idle_ms=args.claim_idle_ms, max_deliveries=args.max_deliveries)
    if os.getcwd() not in sys.path and "" not in sys.path:  # handler modules of the current directory
        sys.path.insert(0, os.getcwd())                     # are found, as celery and rq find them
    handlers = dict(parse_handler_flag(h) for h in args.handler)
    default = load_handler(args.default_handler) if args.default_handler else None
    if not handlers and default is None:
        print("redroll consume: give at least one --handler NAME=module:function or --default-handler",
              file=sys.stderr)
        return 2
    runner = ConsumerRunner(settings, group=args.group, handlers=handlers, default_handler=default,
                            stream=args.stream, batch=args.batch, apply_bytes=args.batch_bytes,
                            burst=args.burst)
    from redroll.observability.metrics import ConsumerMetrics

    return await serve(runner, ConsumerMetrics, args.metrics_port, settings, args.metrics_host)
