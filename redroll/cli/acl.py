"""``redroll acl show|apply``: the least-privilege ACL users of each role (an administrator's command).

``show ROLE`` prints the rules of a role (what follows ``ACL SETUSER <name> reset on >password``,
or ``user <name> on >password`` in an ACL file). ``apply`` creates or resets users as the
connection's (administrator) user: ``--user worker=redroll-worker`` with the password read from
``--password-dir``/``worker`` (a mounted Kubernetes secret: one file per role), and with
``--load-functions`` loads the function library too, so one Job prepares a fresh Redis
(docs/kubernetes.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from redroll.cli.options import add_connection_options, settings_from_args
from redroll.security.acl import ROLES, acl_rules, setuser_args
from redroll.shared.connection import connect
from redroll.shared.functions import load_library


def add_parser(sub: Any) -> None:
    p = sub.add_parser("acl", help="show or apply the least-privilege ACL users of each role (administrator)")
    actions = p.add_subparsers(dest="acl_action", required=True, metavar="ACTION")
    show = actions.add_parser("show", help="print a role's ACL rules (for ACL SETUSER or an ACL file)")
    show.add_argument("role", choices=ROLES)
    show.add_argument("--namespace", default="redroll", help="the pipeline's namespace")
    show.add_argument("--partitions", type=int, default=1, help="the pipeline's partitions")
    show.set_defaults(run=run_show)
    apply = actions.add_parser("apply", help="create or reset role users (ACL SETUSER) as this connection's user")
    add_connection_options(apply)
    apply.add_argument("--user", action="append", required=True, metavar="ROLE=NAME",
                       help=f"a user to create for a role ({', '.join(ROLES)}); repeatable")
    apply.add_argument("--password-dir", required=True, type=Path,
                       help="a folder holding one file per role, named after it (e.g. worker), with its password "
                            "(a mounted secret; surrounding whitespace is stripped)")
    apply.add_argument("--load-functions", action="store_true",
                       help="also load this version's function library (redroll functions load)")
    apply.add_argument("--json", action="store_true", help="JSON for scripts")
    apply.set_defaults(run=run_apply)


def run_show(args: argparse.Namespace) -> int:
    print(acl_rules(args.role, args.namespace, partitions=args.partitions))
    return 0


def _users(pairs: list[str], password_dir: Path) -> list[tuple[str, str, str]]:
    users = []
    for pair in pairs:
        role, sep, name = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"--user {pair!r} must look like ROLE=NAME")
        if role not in ROLES:
            raise ValueError(f"--user {pair!r}: {role!r} is not a role ({', '.join(ROLES)})")
        secret = password_dir / role
        try:
            password = secret.read_text().strip()
        except OSError as exc:
            raise ValueError(f"--password-dir: cannot read the {role} password from {secret}: {exc.strerror}") from None
        if not password:
            raise ValueError(f"--password-dir: {secret} is empty")
        users.append((role, name, password))
    return users


async def run_apply(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    users = _users(args.user, args.password_dir)
    async with connect(settings) as r:
        version = (await r.info("server"))["redis_version"]
        for role, name, password in users:
            await r.execute_command("ACL", "SETUSER", *setuser_args(
                name, password, role, settings.keys, server_version=version, partitions=settings.partitions))
        library = None
        if args.load_functions:
            report = await load_library(r)
            library = report.library
    out = {"users": {name: role for role, name, _ in users}, "library": library}
    print(json.dumps(out) if args.json else
          "users: " + ", ".join(f"{name} ({role})" for role, name, _ in users)
          + (f"; function library {library} loaded" if library else ""))
    return 0
