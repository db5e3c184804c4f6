"""``redroll functions load|show|wait``: the project's Redis function library.

The roles may call the library's functions (FCALL) but not load code (FUNCTION LOAD), so an
administrator (a user with ``+function|load``, or the default user) runs ``redroll functions
load`` once per redroll version, on every primary of a cluster (see docs/acl.md). ``wait`` is
for a role's process that starts before the administrator's load ran (a Kubernetes init
container): it returns once the library is there, probing as the role may (FCALL of its
``version`` function).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import redis

from redroll.cli.options import add_connection_options, settings_from_args
from redroll.shared.connection import connect
from redroll.shared.functions import LIBRARY, function_name, is_missing, library_loaded, load_library


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("functions", help="load (administrator), show or wait for the Redis function library of "
                                         "this version")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, what in (("load", f"FUNCTION LOAD {LIBRARY} on the server (every primary of a cluster), kept where it "
                                "is already (an administrator)"),
                       ("show", "its name and whether the server has it (FUNCTION LIST: an administrator or operator)"),
                       ("wait", "return once the server has it (as any role: an init container's command)")):
        action = actions.add_parser(name, help=what)
        add_connection_options(action)
        action.add_argument("--json", action="store_true", help="JSON for scripts")
        if name == "wait":
            action.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                                help="give up (exit 1) after this long")
        action.set_defaults(run=run)
    return p


async def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    async with connect(settings) as r:
        if args.action == "wait":
            return await _wait(r, args)
        if args.action == "load":
            report = await load_library(r)
            out = {"library": report.library, "loaded": report.loaded, "present": report.present}
            text = (f"{report.library}: loaded on {', '.join(report.loaded)}" if report.loaded
                    else f"{report.library}: already loaded")
            if report.loaded and report.present:
                text += f" (already on {', '.join(report.present)})"
        else:
            loaded = await library_loaded(r)
            out = {"library": LIBRARY, "loaded": loaded}
            text = f"{LIBRARY}: {'loaded' if loaded else 'not loaded (run: redroll functions load)'}"
    print(json.dumps(out) if args.json else text)
    return 0


async def _wait(r: Any, args: argparse.Namespace) -> int:
    """Probe (FCALL of the library's ``version`` function) every half second until it answers."""
    deadline = time.monotonic() + args.timeout
    while True:
        try:
            await r.execute_command("FCALL", function_name("version"), 0)
            print(json.dumps({"library": LIBRARY, "loaded": True}) if args.json else f"{LIBRARY}: loaded")
            return 0
        except redis.ResponseError as exc:
            if not is_missing(exc):
                raise
        if time.monotonic() >= deadline:
            print(f"redroll functions wait: {LIBRARY} is still not loaded after {args.timeout:g} s: an administrator "
                  "runs 'redroll functions load'", file=sys.stderr)
            return 1
        await asyncio.sleep(0.5)
