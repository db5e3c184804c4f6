"""The operator's commands: ``redroll drain``, ``gc``, ``lanes``, ``repair`` and ``abort``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from redroll.cli.options import add_connection_options, connected, seconds_from_zero, usage_error


def _command(parent: Any, name: str, help: str, run: Any) -> argparse.ArgumentParser:
    """A sub-command of ``parent`` that connects (the connection options) and runs ``run``."""
    p = parent.add_parser(name, help=help)
    add_connection_options(p)
    p.set_defaults(run=run)
    return p


JSON_HELP = "JSON for scripts"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("lanes", help="show or change the pipeline's affinity lanes (backlog and owner per lane)")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = _command(actions, "show", "the lanes, each lane's backlog and owner", run_lanes)
    show.add_argument("--json", action="store_true", help=JSON_HELP)
    change = _command(actions, "set", "change the number of lanes (every process must then use it)", run_lanes)
    change.add_argument("lanes", type=int, help="the new number of lanes (0 = off)")
    change.add_argument("--force", action="store_true",
                        help="change it even though lanes still hold entries (they stay there, unread, until L is "
                             "set back: see docs/cluster.md)")
    change.add_argument("--json", action="store_true", help=JSON_HELP)

    p = _command(sub, "repair", "give streams whose ids were exhausted (XADD with the largest id) their ids back",
                 run_repair)
    p.add_argument("streams", nargs="*", help="stream keys to repair, e.g. '{redroll}:results'")
    p.add_argument("--all", action="store_true", help="every stream of the pipeline (requests, results, dead, "
                                                      "control, reply streams)")
    p.add_argument("--dry-run", action="store_true", help="only report which streams are broken")
    p.add_argument("--max-rebuild", type=int, default=None, metavar="N",
                   help="on servers that need the stream rebuilt (Valkey 8), copy at most N entries in the one "
                        "script (default 200000; the server is blocked meanwhile)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)

    p = _command(sub, "drain", "ask workers to drain and exit (through the control stream)", run_drain)
    p.add_argument("workers", nargs="*", help="worker names (see redroll status)")
    p.add_argument("--all", action="store_true", help="every worker")

    p = _command(sub, "gc", "remove reply streams of producers that never came back, gone workers' heartbeats", run_gc)
    p.add_argument("--dry-run", action="store_true", help="only report what would be removed")
    p.add_argument("--stale-worker-s", type=seconds_from_zero, default=3600.0,
                   help="remove heartbeats of workers not seen for this many seconds")
    p.add_argument("--idle-consumer-s", type=seconds_from_zero, default=3600.0,
                   help="remove consumers idle this many seconds that hold nothing")

    p = _command(sub, "abort", "abort requests by request_id or group_id", run_abort)
    p.add_argument("request_ids", nargs="*", help="request ids to abort")
    p.add_argument("--group", action="append", default=[], help="abort every request of this group_id (repeatable)")


async def run_gc(args: argparse.Namespace) -> int:
    from redroll.ops.gc import collect_garbage

    async with connected(args) as (settings, r):
        report = await collect_garbage(r, settings.keys, reply_ttl_s=settings.reply_ttl_s,
                                       partitions=settings.partition_keys,
                                       stale_worker_s=args.stale_worker_s, idle_consumer_s=args.idle_consumer_s,
                                       dry_run=args.dry_run)
    print(json.dumps({"dry_run": args.dry_run, "removed": report.to_json()}, indent=2))
    return 0


async def run_lanes(args: argparse.Namespace) -> int:
    from redroll.shared.lanes import lane_report, set_lanes

    async with connected(args) as (settings, r):
        if args.action == "set":
            try:
                before = await set_lanes(r, settings.keys, settings.with_(affinity_lanes=0).partition_keys,
                                         args.lanes, force=args.force)
            except ValueError as exc:
                print(f"redroll lanes set: {exc}", file=sys.stderr)
                return 1
            print(f"affinity_lanes: {before} -> {args.lanes}; restart producers and workers with "
                  f"REDROLL_AFFINITY_LANES={args.lanes} (processes with another value refuse to start)")
            return 0
        report = await lane_report(r, settings.keys, settings.with_(affinity_lanes=0).partition_keys)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    if not report["lanes"]:
        print(f"affinity lanes are off for {settings.namespace} (set with `redroll lanes set N`)")
        return 0
    print(f"affinity_lanes={report['lanes']}; queued in lanes: {report['backlog']}")
    for lane in report["per_lane"]:
        print(f"  {lane['stream']}: backlog {lane['backlog']}, in flight {lane['pending']}, "
              f"owner {lane['owner'] or '-'}")
    return 0


async def run_repair(args: argparse.Namespace) -> int:
    from redroll.ops.repair import MAX_REBUILD_ENTRIES, pipeline_streams, repair_stream

    if not args.streams and not args.all:
        return usage_error("repair", "name stream keys or --all")
    async with connected(args) as (settings, r):
        keys = args.streams or await pipeline_streams(r, settings.keys, settings.partition_keys)
        limit = args.max_rebuild if args.max_rebuild is not None else MAX_REBUILD_ENTRIES
        reports = [await repair_stream(r, key, dry_run=args.dry_run, max_rebuild=limit) for key in keys]
    if args.json:
        print(json.dumps([x.to_json() for x in reports], indent=2))
    for rep in reports:
        if args.json or rep.state in ("ok", "none"):
            continue
        if rep.state == "repaired":
            print(f"{rep.key}: repaired: last id {rep.last_id} -> {rep.new_last_id}; removed {len(rep.removed)} "
                  f"entr{'y' if len(rep.removed) == 1 else 'ies'} from the future"
                  + (f"; groups moved back: {', '.join(rep.groups_reset)}" if rep.groups_reset else "")
                  + ("; the stream was rebuilt (same entries, groups and pending entries)"
                     if rep.method == "rebuilt" else ""))
        elif rep.state == "toolarge":
            print(f"{rep.key}: ids exhausted and this server needs the stream rebuilt, {rep.length} entries: "
                  f"more than --max-rebuild {limit}; nothing changed (raise it, accepting that the server "
                  "blocks about a second per 100k entries)")
        elif rep.state == "broken":
            print(f"{rep.key}: ids exhausted (last id {rep.last_id}): run without --dry-run to repair")
        else:
            print(f"{rep.key}: a {rep.kind}, not a stream: remove or rename it by hand (redroll recreates the stream)")
    broken = [x for x in reports if x.state in ("broken", "wrongtype", "toolarge")]
    if not args.json:
        print(f"checked {len(reports)} stream(s): {sum(x.state == 'repaired' for x in reports)} repaired, "
              f"{len(broken)} still broken")
    return 1 if broken else 0


async def run_drain(args: argparse.Namespace) -> int:
    from redroll.ops.control import send_command
    from redroll.shared.commands import Drain

    if not args.workers and not args.all:
        return usage_error("drain", "name workers or --all")
    from redroll.ops.control import live_workers

    async with connected(args) as (settings, r):
        if not args.all:
            live = await live_workers(r, settings.keys)
            unknown = [name for name in args.workers if name not in live]
            if unknown:  # (a typo, or a worker already gone: nothing would ever read the command)
                print(f"redroll drain: no live worker named {', '.join(unknown)}; nothing sent (live workers: "
                      f"{', '.join(sorted(live)) or 'none'})", file=sys.stderr)
                return 1
        for target in (["*"] if args.all else args.workers):
            await send_command(r, settings.keys, Drain(target=None if target == "*" else target))
    print("drain sent to " + ("every worker" if args.all else ", ".join(args.workers)))
    return 0


async def run_abort(args: argparse.Namespace) -> int:
    from redroll.ops.control import abort_requests

    if not args.request_ids and not args.group:
        return usage_error("abort", "name request ids or --group G")
    async with connected(args) as (settings, r):
        cancelled = await abort_requests(r, settings.keys, args.request_ids, group_ids=args.group,
                                         parts=settings.partition_keys, what="redroll abort")
    print(f"abort sent for {len(args.request_ids)} request(s) and {len(args.group)} group(s); "
          f"{len(cancelled)} cancelled while still queued")
    return 0
