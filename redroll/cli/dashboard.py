"""``redroll dashboard``: serve the pipeline's web page (:mod:`redroll.web.dashboard.app`) on uvicorn.

It reads with the connection's rights (the ``operator`` ACL user is enough). Requeue and purge are
enabled only with ``--allow-actions``, which then requires administrator credentials (``--admin-url``
and/or ``--admin-username`` with ``--admin-password-file``) and ``--token-file`` (the bearer token the
page sends with each action); without ``--allow-actions`` those flags are refused, so a read-only
dashboard never holds them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

from redroll.cli.options import (
    BIND_HELP,
    LOCALHOST,
    add_connection_options,
    listening_socket,
    settings_from_args,
    usage_error,
)

log = logging.getLogger("redroll.web.dashboard.app")

ADMIN_FLAGS = ("admin_url", "admin_username", "admin_password_file", "token_file")


def _interval(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number of seconds") from None
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be between 0.1 and 3600 seconds, got {raw}")
    return value


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``redroll dashboard`` on the command line's sub-parsers."""
    p = sub.add_parser("dashboard", help="serve a live web page of the pipeline: queues, workers, weight versions, "
                                         "dead letters (requeue and purge with --allow-actions)")
    add_connection_options(p)
    p.add_argument("--host", default=LOCALHOST, help=BIND_HELP)
    p.add_argument("--port", type=int, default=8470, help="the port (0 = any free port; the URL is printed)")
    p.add_argument("--interval", type=_interval, default=1.0, help="seconds between the page's refreshes")
    g = p.add_argument_group("actions that change state (requeue and purge dead letters)")
    g.add_argument("--allow-actions", action="store_true",
                   help="enable requeue and purge on the page; needs administrator credentials and --token-file")
    g.add_argument("--admin-url", default=None,
                   help="the administrator's redis URL (default: --redis-url), e.g. redis://admin:PASSWORD@host:6379")
    g.add_argument("--admin-username", default=None, help="the administrator's ACL user")
    g.add_argument("--admin-password-file", default=None, help="file holding the administrator's password")
    g.add_argument("--token-file", default=None,
                   help="file holding the bearer token the page must send with each action")
    p.set_defaults(run=run)
    return p


def refusal(args: argparse.Namespace) -> str | None:
    """Why these arguments cannot start a dashboard, or None (checked before connecting)."""
    given = [f"--{name.replace('_', '-')}" for name in ADMIN_FLAGS if getattr(args, name) is not None]
    if not args.allow_actions:
        if given:
            return f"{', '.join(given)} only with --allow-actions (a read-only dashboard holds no administrator rights)"
        return None
    if args.token_file is None:
        return "--allow-actions needs --token-file (the bearer token the page sends with each action)"
    if args.admin_url is None and args.admin_username is None:
        return "--allow-actions needs administrator credentials: --admin-url and/or --admin-username"
    if args.admin_username is not None and args.admin_password_file is None and args.admin_url is None:
        return "--admin-username needs --admin-password-file"
    try:
        token = Path(args.token_file).read_text().strip()
    except OSError as exc:
        return f"--token-file: cannot read {args.token_file}: {exc.strerror or exc}"
    if len(token) < 16:
        return f"--token-file: {args.token_file} holds {len(token)} characters; use a token of at least 16"
    return None


async def run(args: argparse.Namespace) -> int:
    """Serve until interrupted. Exit status 2 for arguments that cannot start it."""
    from redroll.shared.connection import connect

    settings = settings_from_args(args)
    problem = refusal(args)
    if problem:
        return usage_error("dashboard", problem)
    try:
        import uvicorn

        from redroll.web.dashboard.app import LOOPBACK_HOSTS, Actions, create_app, is_loopback
    except ImportError as exc:
        print(f"redroll dashboard: needs Starlette and uvicorn: pip install 'redroll[dashboard]' ({exc})",
              file=sys.stderr)
        return 2
    admin_settings = None
    if args.allow_actions:
        admin_settings = settings.with_(redis_url=args.admin_url or settings.redis_url,
                                        redis_username=args.admin_username, redis_password=None,
                                        redis_password_file=args.admin_password_file)
    async with connect(settings) as r:
        await r.ping()
        actions = admin = None
        if admin_settings is not None:
            admin = connect(admin_settings)
            await admin.ping()
            actions = Actions(admin, admin_settings, Path(args.token_file).read_text().strip())
        try:
            app = create_app(r, settings, actions=actions, interval_s=args.interval,
                             allowed_hosts=list(LOOPBACK_HOSTS) if is_loopback(args.host) else None)
            sock = listening_socket(args.host, args.port)
            host, port = sock.getsockname()[:2]
            where = f"[{host}]" if ":" in host else host
            print(f"redroll dashboard: http://{where}:{port}/ (namespace {settings.namespace!r}, actions "
                  f"{'enabled' if actions else 'disabled'})", flush=True)
            if actions is not None and not is_loopback(args.host):
                log.warning("actions are enabled on %s: the bearer token crosses the network in clear unless a "
                            "TLS proxy is in front", args.host)
            server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
            await server.serve(sockets=[sock])
        except asyncio.CancelledError:
            pass
        finally:
            if admin is not None:
                await admin.aclose()
    return 0
