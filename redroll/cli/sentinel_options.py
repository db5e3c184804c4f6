"""Command-line flags for Redis Sentinel and replicated durability, shared by every command that
connects (``worker``, ``submit``, ``consume``, ``status``, ...). Each has its ``REDROLL_*``
variable; the Sentinel itself is named by the URL (``--redis-url redis+sentinel://...``)."""

from __future__ import annotations

import argparse
from typing import Any

SETTINGS = ("sentinel_username", "sentinel_password_file", "wait_replicas", "wait_timeout_ms", "wait_aof")
"""The Settings fields these flags set (``_settings`` in redroll.cli.main passes them on)."""


def add_arguments(g: Any) -> None:
    """Add the flags to ``g`` (the connection argument group of a command)."""
    g.add_argument("--sentinel-username", default=argparse.SUPPRESS,
                   help="with a redis+sentinel:// URL: the sentinels' ACL user (env REDROLL_SENTINEL_USERNAME)")
    g.add_argument("--sentinel-password-file", default=argparse.SUPPRESS,
                   help="file holding the sentinels' password (env REDROLL_SENTINEL_PASSWORD_FILE; or "
                        "REDROLL_SENTINEL_PASSWORD)")
    g.add_argument("--wait-replicas", type=int, default=argparse.SUPPRESS, metavar="N",
                   help="acknowledge a submit, finish or consumer ack only once N replicas have it "
                        "(env REDROLL_WAIT_REPLICAS; default 0 = asynchronous replication)")
    g.add_argument("--wait-timeout-ms", type=int, default=argparse.SUPPRESS, metavar="MS",
                   help="how long one wait for the replicas lasts before the write is sent again "
                        "(env REDROLL_WAIT_TIMEOUT_MS; default 1000)")
    g.add_argument("--wait-aof", action="store_const", const=True, default=argparse.SUPPRESS,
                   help="wait with WAITAOF: fsynced on the primary and N replicas (Redis 7.2+, Valkey 8, "
                        "appendonly yes; env REDROLL_WAIT_AOF=1)")
