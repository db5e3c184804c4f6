"""The ``redroll`` command line (argparse: no dependency, sub-commands, env defaults).

Each command group is a module of :mod:`redroll.cli`; :data:`COMMAND_GROUPS` registers them.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from typing import Sequence

import redis

from redroll.cli import (
    acl,
    bench,
    capacity,
    consume,
    dashboard,
    dead,
    demo,
    functions,
    operations,
    serve,
    submit,
    trace,
    weights,
    worker,
)
from redroll.cli.options import HelpFormatter, every_parser, unit_metavar
from redroll.cli.runtime import run as run_async_main
from redroll.shared.connection import RedisConfigError, describe_error
from redroll.shared.lanes import LanesMismatchError
from redroll.shared.settings import Settings

__all__ = ["COMMAND_GROUPS", "build_parser", "main"]

COMMAND_GROUPS = (demo, worker, consume, submit, serve, dashboard, weights, dead, trace, operations, functions,
                  acl, capacity, bench)
"""The modules that add the commands (each has ``add_parser(sub)``), in the order the help lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="redroll", description="Queue-driven LLM generation on Redis Streams.")
    from redroll import __version__

    parser.add_argument("--version", action="version", version=f"redroll {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in COMMAND_GROUPS:
        group.add_parser(sub)
    for each in every_parser(parser):
        each.formatter_class = HelpFormatter
        for action in each._actions:
            if action.option_strings and action.metavar is None and action.nargs != 0:
                action.metavar = unit_metavar(action)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from redroll.observability.logs import setup_logging

    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:  # (bare `redroll`: the commands, not an argparse error)
        build_parser().print_help()
        return 0
    if argv[:1] == ["bench"]:  # everything after it belongs to the benchmark suite's own parser
        return bench.run(argv[1:])
    args = build_parser().parse_args(argv)
    setup_logging(getattr(args, "log_level", os.environ.get("REDROLL_LOG_LEVEL", "info")),
                  getattr(args, "log_format", os.environ.get("REDROLL_LOG_FORMAT", "text")))
    try:
        settings_for_errors = Settings.from_env(redis_url=getattr(args, "redis_url", None))
    except ValueError as exc:  # (a REDROLL_* variable that is not a valid value)
        print(f"redroll {args.command}: {exc}", file=sys.stderr)
        return 2
    try:
        status = args.run(args)
        return run_async_main(status) if inspect.isawaitable(status) else status
    except KeyboardInterrupt:
        return 130
    except (redis.RedisError, RedisConfigError) as exc:
        print(f"redroll {args.command}: {describe_error(exc, settings_for_errors)}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"redroll {args.command}: {exc}", file=sys.stderr)
        return 1
    except (ValueError, ImportError) as exc:
        print(f"redroll {args.command}: {exc}", file=sys.stderr)
        return 2
    except LanesMismatchError as exc:
        print(f"redroll {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
