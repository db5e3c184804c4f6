"""What every ``redroll`` command shares: the connection options, argument types, the help
formatter, and the settings the options make."""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys
from typing import Any, AsyncIterator

from redis.asyncio import Redis

from redroll.shared.connection import connect
from redroll.shared.settings import Settings
from redroll.shared.values import (  # noqa: F401  (the argument types every command uses)
    non_negative_int,
    number_of_seconds,
    positive_gib,
    positive_int,
    positive_seconds,
    seconds_from_zero,
)

CONNECTION_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--redis-url", dict(help="redis://, rediss://, unix:// or redis+sentinel://host:port,.../master URL "
                              "(env REDROLL_REDIS_URL)")),
    ("--namespace", dict(help="pipeline namespace (env REDROLL_NAMESPACE)")),
    ("--partitions", dict(type=int, help="partitions of the pipeline, {ns:0}..{ns:P-1} (env REDROLL_PARTITIONS; "
                                         "default 1)")),
    ("--affinity-lanes", dict(type=int, metavar="L", help="affinity lanes per partition (env REDROLL_AFFINITY_LANES; "
                              "default 0 = off); every process of a pipeline must use the pipeline's L (see "
                              "`redroll lanes`)")),
    ("--steal-after-ms", dict(type=int, metavar="MS", help="with affinity lanes: any worker takes an entry that "
                              "waited this long in a lane (env REDROLL_STEAL_AFTER_MS; default 1000)")),
    ("--cluster", dict(dest="redis_cluster", action="store_const", const=True,
                       help="the URL names a node of a Redis Cluster (env REDROLL_REDIS_CLUSTER=1)")),
    ("--redis-username", dict(help="ACL user (env REDROLL_REDIS_USERNAME)")),
    ("--redis-password-file", dict(help="file holding the password (env REDROLL_REDIS_PASSWORD_FILE; or "
                                        "REDROLL_REDIS_PASSWORD)")),
    ("--tls-ca-file", dict(help="with rediss://: the CA that signed the server's certificate (env "
                                "REDROLL_TLS_CA_FILE; default: the system's CAs)")),
    ("--tls-cert-file", dict(help="with rediss://: this client's certificate, for servers that require one "
                                  "(env REDROLL_TLS_CERT_FILE)")),
    ("--tls-key-file", dict(help="with rediss://: the key of --tls-cert-file (env REDROLL_TLS_KEY_FILE)")),
    # Redis Sentinel (named by the URL, redis+sentinel://...) and replicated durability.
    ("--sentinel-username", dict(help="with a redis+sentinel:// URL: the sentinels' ACL user (env "
                                      "REDROLL_SENTINEL_USERNAME)")),
    ("--sentinel-password-file", dict(help="file holding the sentinels' password (env "
                                           "REDROLL_SENTINEL_PASSWORD_FILE; or REDROLL_SENTINEL_PASSWORD)")),
    ("--wait-replicas", dict(type=int, metavar="N", help="acknowledge a submit, finish or consumer ack only once "
                             "N replicas have it (env REDROLL_WAIT_REPLICAS; default 0 = asynchronous replication)")),
    ("--wait-timeout-ms", dict(type=int, metavar="MS", help="how long one wait for the replicas lasts before the "
                               "write is sent again (env REDROLL_WAIT_TIMEOUT_MS; default 1000)")),
    ("--wait-aof", dict(action="store_const", const=True, help="wait with WAITAOF: fsynced on the primary and N "
                        "replicas (Redis 7.2+, Valkey 8, appendonly yes; env REDROLL_WAIT_AOF=1)")),
)
"""The connection flags of every command that connects, with ``add_argument``'s options: each sets
the Settings field it is named after (``--cluster``: its ``dest``), and only when given (else the
``REDROLL_*`` variable, else the default: see :func:`settings_from_args`)."""

CONNECTION_SETTINGS = tuple(options.get("dest", flag[2:].replace("-", "_")) for flag, options in CONNECTION_FLAGS)
"""The Settings fields the connection flags set."""


def add_connection_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("connection (also REDROLL_* environment variables)")
    for flag, options in CONNECTION_FLAGS:
        g.add_argument(flag, default=argparse.SUPPRESS, **options)
    g.add_argument("--log-level", default=argparse.SUPPRESS, choices=["debug", "info", "warning", "error"],
                   help="log level (env REDROLL_LOG_LEVEL; default info)")
    g.add_argument("--log-format", default=argparse.SUPPRESS, choices=["text", "json"],
                   help="log lines as text or one JSON object each (env REDROLL_LOG_FORMAT; default text)")


def usage_error(command: str, message: str) -> int:
    """Say why ``redroll COMMAND`` with these arguments cannot run (one line on stderr); the exit
    status of a usage error, 2."""
    print(f"redroll {command}: {message}", file=sys.stderr)
    return 2


LOCALHOST = "127.0.0.1"
"""Where every socket redroll listens on is bound unless told otherwise (``--host``,
``--metrics-host``): the gateway, the dashboard, the exporter and the workers' and consumers'
metrics. Open one up on purpose, e.g. ``--host 0.0.0.0`` in a container."""

BIND_HELP = "the address to listen on (default 127.0.0.1, this machine only; 0.0.0.0 for every interface)"


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port`` (0: any free port), made before anything starts, so a port
    in use is one line and exit status 1 (an ``OSError`` the command line reports), not a server that
    started its connections and cannot listen."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def add_delivery_flags(p: argparse.ArgumentParser, item: str, holder: str) -> None:
    """``--claim-idle-ms`` and ``--max-deliveries`` of a worker (``item`` "request") or a consumer
    ("record"): when another ``holder``'s entry is taken over, and when one is dead-lettered."""
    p.add_argument("--claim-idle-ms", type=int, default=None,
                   help=f"take over a {item} {holder} has held this long without progress "
                        f"(env REDROLL_CLAIM_IDLE_MS; default {SETTING_DEFAULTS.claim_idle_ms})")
    p.add_argument("--max-deliveries", type=int, default=None,
                   help=f"dead-letter a {item} after this many deliveries "
                        f"(env REDROLL_MAX_DELIVERIES; default {SETTING_DEFAULTS.max_deliveries})")


def add_metrics_flags(p: argparse.ArgumentParser) -> None:
    """``--metrics-port`` and ``--metrics-host`` of a long-running worker or consumer."""
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--metrics-host", default=LOCALHOST, help="with --metrics-port: " + BIND_HELP)


SETTING_DEFAULTS = Settings()
"""The settings' own defaults, as the help shows them."""


def settings_from_args(args: argparse.Namespace, **extra: Any) -> Settings:
    overrides = {k: getattr(args, k) for k in CONNECTION_SETTINGS if hasattr(args, k)}
    overrides.update({k: v for k, v in extra.items() if v is not None})
    return Settings.from_env(**overrides)


@contextlib.asynccontextmanager
async def connected(args: argparse.Namespace) -> AsyncIterator[tuple[Settings, Redis]]:
    """The settings the options make and a client on their Redis, closed on leaving the block:
    ``async with connected(args) as (settings, r):``."""
    settings = settings_from_args(args)
    async with connect(settings) as r:
        yield settings, r


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default after its help, unless the help already says it or there is none to say."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (action.default in (None, False, [], argparse.SUPPRESS) or "default" in text
                or not action.option_strings):
            return text
        return super()._get_help_string(action)


_SECONDS_TYPES = ("positive_seconds", "seconds_from_zero", "number_of_seconds")


def unit_metavar(action: argparse.Action) -> str | None:
    """A flag's value as ``--help`` shows it, its unit named: ``MS`` for milliseconds, ``SECONDS``
    for seconds (the name or the parser says which), else argparse's own."""
    name = action.option_strings[0].lstrip("-")
    parser_name = getattr(action.type, "__name__", "")
    if name.endswith("-ms"):
        return "MS"
    if (name.endswith("-s") or parser_name in _SECONDS_TYPES or name.endswith("timeout")
            or name in ("idempotency-window", "interval")):
        return "SECONDS"
    return None


def every_parser(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """``parser`` and every sub-command's parser, depth first."""
    out = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                out.extend(every_parser(child))
    return out
