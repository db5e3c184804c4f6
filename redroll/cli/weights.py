"""``redroll weights``: broadcast a weight update, or release/resume engine memory."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from redroll.cli.options import add_connection_options, positive_seconds, settings_from_args
from redroll.shared.connection import connect


def add_parser(sub: Any) -> None:
    p = sub.add_parser("weights", help="broadcast a weight update, or release/resume engine memory")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    update = actions.add_parser("update", help="broadcast new weights; by default wait until every live worker "
                                               "runs them (late joiners load them before claiming)")
    add_connection_options(update)
    update.add_argument("--model-path", required=True, help="the new weights (a path the workers can read)")
    update.add_argument("--version", required=True, help="the new weight_version")
    update.add_argument("--abort-inflight", action="store_true",
                        help="abort in-flight requests instead of letting them finish")
    update.add_argument("--in-place", action="store_true",
                        help="swap the weights under the requests in flight (between two decode steps; their "
                             "records carry per-token versions) instead of waiting for them")
    update.add_argument("--no-wait", action="store_true", help="do not wait for every live worker")
    update.add_argument("--timeout", type=positive_seconds, default=600.0, help="seconds to wait for the workers")
    for name, what in (("release", "free engine memory for a colocated trainer (GPU: SGLang's memory saver, "
                                   "vLLM's sleep mode)"),
                       ("resume", "take the released engine memory back")):
        action = actions.add_parser(name, help=what)
        add_connection_options(action)
        action.add_argument("--no-wait", action="store_true", help="do not wait for the workers")
        action.add_argument("--timeout", type=positive_seconds, default=120.0, help="seconds to wait for the workers")
    show = actions.add_parser("show", help="the pipeline's desired weights (JSON)")
    add_connection_options(show)
    for action in actions.choices.values():
        action.set_defaults(run=run)


async def run(args: argparse.Namespace) -> int:
    from redroll.ops.control import send_command, update_weights, wait_for_memory_command
    from redroll.shared.commands import ReleaseMemory, ResumeMemory

    settings = settings_from_args(args)
    async with connect(settings) as r:
        try:
            if args.action == "show":
                desired = {k.decode(): v.decode() for k, v in (await r.hgetall(settings.keys.weights)).items()}
                print(json.dumps(desired or None))
                return 0
            if args.action == "update":
                if args.in_place and args.abort_inflight:
                    print("redroll weights update: --in-place and --abort-inflight exclude each other",
                          file=sys.stderr)
                    return 2
                workers = await update_weights(r, settings.keys, args.model_path, args.version,
                                               abort_inflight=args.abort_inflight,
                                               mode="in_place" if args.in_place else None, wait=not args.no_wait,
                                               timeout=args.timeout)
                print(f"weights {args.version} ({args.model_path}) " +
                      ("broadcast" if args.no_wait else f"running on {len(workers)} live worker(s)"))
                return 0
            kind = "release_memory" if args.action == "release" else "resume_memory"
            sent = await send_command(r, settings.keys, ReleaseMemory() if args.action == "release" else ResumeMemory())
            if args.no_wait:
                print(f"{kind} broadcast")
                return 0
            want = "released" if args.action == "release" else "running"
            done, failed = await wait_for_memory_command(r, settings.keys, kind, sent, want,
                                                         timeout=args.timeout)
            for worker, error in sorted(failed.items()):
                print(f"redroll weights {args.action}: worker {worker} refused: {error}", file=sys.stderr)
            print(f"{kind}: {len(done)} worker(s) {want}" + (f", {len(failed)} refused" if failed else ""))
            return 1 if failed else 0
        except TimeoutError as exc:
            print(f"redroll weights: {exc}", file=sys.stderr)
            return 1
