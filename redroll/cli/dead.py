"""``redroll dead``: list, requeue or purge dead letters."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from redroll.cli.options import add_connection_options, positive_int, seconds_from_zero, settings_from_args, usage_error
from redroll.shared.connection import connect


def add_parser(sub: Any) -> None:
    p = sub.add_parser("dead", help="list, requeue or purge dead letters")
    add_connection_options(p)
    dsub = p.add_subparsers(dest="dead_command", required=True, metavar="ACTION")
    d = dsub.add_parser("list", help="dead letters, oldest first")
    add_connection_options(d)
    d.add_argument("--reason", default=None, help="only those whose reason contains this text")
    d.add_argument("--json", action="store_true", help="JSON for scripts (every field whole)")
    d.add_argument("--count", type=positive_int, default=1000, help="at most this many per partition")
    d = dsub.add_parser("requeue", help="re-validate and requeue dead letters")
    add_connection_options(d)
    d.add_argument("ids", nargs="*", help="dead-letter entry ids (see dead list)")
    d.add_argument("--all", action="store_true", help="every dead letter")
    d.add_argument("--set", action="append", default=[], metavar="FIELD.PATH=JSON",
                   help="patch the request before requeueing, e.g. sampling_params.temperature=0.7")
    d = dsub.add_parser("purge", help="delete dead letters")
    add_connection_options(d)
    d.add_argument("ids", nargs="*", help="dead-letter entry ids (see dead list)")
    d.add_argument("--older-than", type=seconds_from_zero, default=None, metavar="SECONDS",
                   help="every dead letter older than this")
    d.add_argument("--all", action="store_true", help="every dead letter")
    p.set_defaults(run=run)


def dead_table(entries: Sequence[Any], title: str, width: int) -> Any:
    """``redroll dead list`` as a table of one line a row that fits ``width`` columns: the reason,
    then the request_id, are cut short with an ellipsis (``--json`` has them whole)."""
    from rich import box
    from rich.table import Table

    rows = [(e.id, e.request_id or "-", e.source, str(e.deliveries), f"{e.age_s:.0f}", e.reason) for e in entries]
    heads = ("id", "request_id", "source", "tries", "age s")
    fits = [max([len(head), *(len(row[i]) for row in rows)]) for i, head in enumerate(heads)]
    fits[1] = min(fits[1], 32)
    between = 3 * len(heads)  # (a space each side of a column and a rule between two)
    spare = width - sum(fits) - between
    if spare < 30:  # the request_id gives way first, down to 12 characters
        fits[1] = max(min(fits[1], 12), fits[1] - (30 - spare))
        spare = width - sum(fits) - between
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, title_justify="left")
    for head, fit in zip(heads, fits):
        table.add_column(head, no_wrap=True, overflow="ellipsis", min_width=fit, max_width=fit)
    reason = max(8, spare)
    table.add_column("reason", no_wrap=True, overflow="ellipsis", min_width=min(reason, 8), max_width=reason)
    for row in rows:
        table.add_row(*row)
    return table


async def run(args: argparse.Namespace) -> int:
    from redroll.ops import dead

    settings = settings_from_args(args)
    async with connect(settings) as r:
        if args.dead_command == "list":
            entries = [e for part in settings.partition_keys
                       for e in await dead.list_dead(r, part, reason=args.reason, count=args.count)]
            if args.json:
                print(json.dumps([e.to_json() for e in entries], indent=2))
                return 0
            from rich.console import Console

            console = Console()
            console.print(dead_table(entries, f"dead letters in {settings.keys.dead} ({len(entries)})", console.width))
            return 0
        if args.dead_command == "requeue":
            if not args.ids and not args.all:
                return usage_error("dead requeue", "name entry ids or --all")
            done, refused = await dead.requeue(r, settings, None if args.all else args.ids,
                                               patches=dead.parse_patches(args.set))
            for msg in refused:
                print(f"refused {msg}", file=sys.stderr)
            print(f"requeued {len(done)} dead letter(s)")
            return 0 if not refused else 3
        if not args.ids and args.older_than is None and not args.all:
            return usage_error("dead purge", "name entry ids, --older-than SECONDS or --all")
        n = 0
        for part in settings.partition_keys:
            n += await dead.purge(r, part, args.ids or None, older_than_s=args.older_than)
        print(f"purged {n} dead letter(s)")
        return 0
