"""``redroll submit``, ``redroll status`` and ``redroll exporter``: put requests in, see the pipeline."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from redroll.cli.options import BIND_HELP, LOCALHOST, add_connection_options, positive_seconds, settings_from_args
from redroll.cli.runtime import run as run_async_main
from redroll.shared.connection import connect


def add_parser(sub: Any) -> None:
    p = sub.add_parser("submit", help="submit requests from a JSONL file (one request per line)")
    add_connection_options(p)
    p.add_argument("file", help="JSONL file, or - for standard input")
    p.add_argument("--wait", action="store_true", help="wait for every record (through a private reply stream)")
    p.add_argument("--out", default=None, help="with --wait: write records here as JSONL (default stdout)")
    p.add_argument("--timeout", type=positive_seconds, default=None, help="with --wait: give up after this many seconds")
    p.add_argument("--resume", action="store_true",
                   help="with --wait --out: take over the interrupted (or timed-out) run that wrote --out: its "
                        "requests with a record there are skipped, those still queued or in flight are taken over "
                        "(not run again), the rest submitted; records are appended")
    p.add_argument("--no-progress", action="store_true",
                   help="with --wait: no progress on stderr (a bar on a terminal; elsewhere a line every 10 s "
                        "and one at the end)")
    p.set_defaults(run=run_submit)

    p = sub.add_parser("status", help="depth, pending, lag, workers, dead letters")
    add_connection_options(p)
    p.add_argument("--json", action="store_true", help="stable JSON for scripts")
    p.add_argument("--watch", action="store_true", help="refresh every --interval seconds")
    p.add_argument("--interval", type=positive_seconds, default=2.0, help="seconds between --watch refreshes")
    p.set_defaults(run=run_status)

    p = sub.add_parser("exporter", help="serve the pipeline's Prometheus /metrics (backlog, workers, dead letters, "
                                        "weight versions, Redis memory), from Redis alone, as status reads it")
    add_connection_options(p)
    p.add_argument("--port", type=int, required=True, help="serve /metrics on this port (0 = any free port)")
    p.add_argument("--host", default=LOCALHOST, help=BIND_HELP)
    p.add_argument("--interval", type=positive_seconds, default=5.0,
                   help="seconds between snapshots of the pipeline (each scrape reads the latest)")
    p.set_defaults(run=run_exporter)


def run_submit(args: argparse.Namespace) -> int:
    from redroll.cli.batch_resume import ResumeError
    from redroll.cli.batch_run import InputError, submit_file

    if not args.wait and (args.out is not None or args.timeout is not None):
        print("redroll submit: --out and --timeout need --wait (without it the records go to the "
              "results stream, for consumer groups)", file=sys.stderr)
        return 2
    if args.resume and (not args.wait or args.out is None):
        print("redroll submit: --resume needs --wait and --out (it continues the run that wrote --out)",
              file=sys.stderr)
        return 2
    try:
        return run_async_main(submit_file(settings_from_args(args), args.file, wait=args.wait, out=args.out,
                                          progress=not args.no_progress, timeout=args.timeout,
                                          resume=args.resume))
    except (InputError, ResumeError) as exc:
        print(f"redroll submit: {exc}", file=sys.stderr)
        return 2


async def run_status(args: argparse.Namespace) -> int:
    from redroll.ops.status import collect_pipeline_status, render_status

    settings = settings_from_args(args)
    async with connect(settings) as r:
        def snapshot() -> Any:
            return collect_pipeline_status(r, settings.keys, settings.partition_keys)

        if args.json and not args.watch:
            print(json.dumps(await snapshot(), indent=2, sort_keys=True))
            return 0
        if args.json:  # one JSON document a line, every interval, the first at once: nothing else on stdout
            while True:
                print(json.dumps(await snapshot(), sort_keys=True), flush=True)
                await asyncio.sleep(args.interval)
        from rich.console import Console
        from rich.live import Live

        if not args.watch:
            Console().print(render_status(await snapshot()))
            return 0
        if not sys.stdout.isatty():  # piped or redirected: plain frames, each flushed as it is printed
            console = Console()
            while True:
                console.print(render_status(await snapshot()))
                sys.stdout.flush()
                await asyncio.sleep(args.interval)
        with Live(render_status(await snapshot()), refresh_per_second=4) as live:
            while True:
                await asyncio.sleep(args.interval)
                live.update(render_status(await snapshot()))


async def run_exporter(args: argparse.Namespace) -> int:
    from redroll.observability.exporter import run_exporter

    settings = settings_from_args(args)
    async with connect(settings) as r:
        await run_exporter(r, settings.keys, settings.partition_keys, args.port, args.interval, addr=args.host)
    return 0
