"""``redroll functions load|show``: an administrator loads the project's Redis function library.

The roles may call the library's functions (FCALL) but not load code (FUNCTION LOAD), so an
administrator (a user with ``+function|load``, or the default user) runs ``redroll functions
load`` once per redroll version, on every primary of a cluster (see docs/acl.md).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from redroll.cli.options import add_connection_options, settings_from_args
from redroll.shared.connection import connect
from redroll.shared.functions import LIBRARY, library_loaded, load_library


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("functions", help="load (administrator) or show the Redis function library of this version")
    add_connection_options(p)
    p.add_argument("action", choices=["load", "show"],
                   help=f"load: FUNCTION LOAD {LIBRARY} on the server (every primary of a cluster), kept where "
                        "it is already; show: its name and whether the server has it")
    p.add_argument("--json", action="store_true", help="JSON for scripts")
    p.set_defaults(run=run)
    return p


async def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    async with connect(settings) as r:
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
