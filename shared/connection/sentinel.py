"""Redis Sentinel: the ``redis+sentinel://`` URL and the clients that follow the primary it names.

redis-py's :class:`~redis.asyncio.sentinel.Sentinel` takes a list of addresses, not a URL; redroll
names a Sentinel-managed primary with one URL, so that every process (worker, producer, consumer,
CLI) takes it where it takes any Redis URL (``REDROLL_REDIS_URL``, ``--redis-url``)::

    redis+sentinel://host1[:port][,host2[:port]...]/<master name>[/<db>]
    rediss+sentinel://...      (TLS to the sentinels and to the primary)

A port left out is 26379. Credentials never go in this URL (one user:password could not say
whether it is the sentinels' or the primary's): the primary's come from ``redis_username`` /
``redis_password`` (``_file``), the sentinels' from ``sentinel_username`` / ``sentinel_password``
(``_file``). TLS files (``tls_ca_file``, ``tls_cert_file``, ``tls_key_file``) serve both.

A client asks the sentinels for the primary's address whenever it opens a connection; after a
failover its connections to the old primary fail (or, to a demoted one, answer READONLY, which
redis-py turns into a connection error and a fresh look-up), and the retry paths that serve an
outage reconnect to the new primary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import redis
import redis.asyncio
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.sentinel import (
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)
from redis.sentinel import Sentinel as SyncSentinel

from redroll.shared.errors import RedisConfigError
from redroll.shared.settings import Settings

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
DEFAULT_SENTINEL_PORT = 26379


def is_sentinel_url(url: str) -> bool:
    return url.partition("://")[0] in SENTINEL_SCHEMES


@dataclass(frozen=True)
class SentinelAddress:
    """What a ``redis+sentinel://`` URL names."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int
    tls: bool


def parse_sentinel_url(url: str) -> SentinelAddress:
    """The sentinels, master name, db and TLS of ``url``; a URL that cannot work raises
    :class:`~redroll.shared.errors.RedisConfigError` naming what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SENTINEL_SCHEMES:
        raise RedisConfigError(f"redis URL {url!r} is not a redis+sentinel:// or rediss+sentinel:// URL")
    netloc, _, path = rest.partition("/")
    if "@" in netloc:
        raise RedisConfigError(
            f"redis URL {redact_sentinel_url(url)!r}: a Sentinel URL carries no credentials: set "
            "REDROLL_REDIS_USERNAME / REDROLL_REDIS_PASSWORD for the primary and REDROLL_SENTINEL_USERNAME / "
            "REDROLL_SENTINEL_PASSWORD for the sentinels")
    sentinels = []
    for item in netloc.split(","):
        host, port = _host_port(item.strip(), url)
        sentinels.append((host, port))
    segments = [unquote(s) for s in path.split("/") if s != ""]
    if not segments or len(segments) > 2:
        raise RedisConfigError(f"redis URL {url!r} must name the master after the sentinels: "
                               f"{scheme}://host1:26379,host2:26379/<master name>[/<db>]")
    db = 0
    if len(segments) == 2:
        if not segments[1].isdigit():
            raise RedisConfigError(f"redis URL {url!r}: the database {segments[1]!r} is not a number")
        db = int(segments[1])
    return SentinelAddress(tuple(sentinels), segments[0], db, scheme == "rediss+sentinel")


def _host_port(item: str, url: str) -> tuple[str, int]:
    if not item:
        raise RedisConfigError(f"redis URL {url!r} names an empty sentinel address")
    if item.startswith("["):  # [ipv6]:port
        host, _, port = item[1:].partition("]")
        port = port.lstrip(":")
    else:
        host, _, port = item.rpartition(":") if ":" in item else (item, "", "")
    if not port:
        return host, DEFAULT_SENTINEL_PORT
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise RedisConfigError(f"redis URL {url!r}: sentinel {item!r} has no valid port")
    return host, int(port)


def redact_sentinel_url(url: str) -> str:
    """``url`` with anything before an ``@`` (credentials a Sentinel URL must not carry) hidden."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    return f"{scheme}{sep}{netloc}{slash}{path}"


def credentials(username: str | None, password: str | None, password_file: str | None, whose: str
                ) -> dict[str, str]:
    """A client's ``username`` and ``password`` keywords (those given): the password read from
    ``password_file`` when one is named (surrounding whitespace stripped; unreadable:
    :class:`RedisConfigError` naming it)."""
    kw = {"username": username} if username else {}
    if password_file:
        try:
            password = Path(password_file).read_text().strip()
        except OSError as exc:
            raise RedisConfigError(f"cannot read {whose} password file {password_file}: {exc}") from None
    if password:
        kw["password"] = password
    return kw


def sentinel_connection_kwargs(settings: Settings, address: SentinelAddress, data_kwargs: dict[str, Any]
                               ) -> dict[str, Any]:
    """How to talk to the sentinels themselves: their own credentials, the same TLS files and
    socket timeouts as the primary."""
    kw: dict[str, Any] = {k: v for k, v in data_kwargs.items() if k.startswith("socket_")}
    kw["decode_responses"] = False
    kw.update(credentials(settings.sentinel_username, settings.sentinel_password, settings.sentinel_password_file,
                          "sentinel"))
    if address.tls:
        kw["ssl"] = True
        kw.update({k: v for k, v in data_kwargs.items() if k.startswith("ssl_")})
    return kw


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """A Sentinel pool that waits (``timeout``) for a free connection instead of failing under a
    burst, as the project's other pools do."""


def connect_sentinel(settings: Settings, data_kwargs: dict[str, Any], retry: Any, max_connections: int,
                     connection_class: Any) -> redis.asyncio.Redis:
    """An asyncio client of the primary ``settings.redis_url`` names (see the module's doc).

    ``connection_class`` wraps redis-py's Sentinel-managed connection (it is passed the plain or
    TLS one and returns the class to use)."""
    address = parse_sentinel_url(settings.redis_url)
    sentinel = Sentinel(list(address.sentinels),
                        sentinel_kwargs=sentinel_connection_kwargs(settings, address, data_kwargs))
    base = SentinelManagedSSLConnection if address.tls else SentinelManagedConnection
    kw = dict(data_kwargs, db=address.db, retry=retry, connection_class=connection_class(base))
    client = sentinel.master_for(address.master, connection_pool_class=_BlockingSentinelPool,
                                 max_connections=max_connections, timeout=20, **kw)
    client.retry = retry
    return client


def connect_sentinel_sync(settings: Settings, data_kwargs: dict[str, Any], retry: Any) -> redis.Redis:
    """A blocking client of the primary ``settings.redis_url`` names."""
    address = parse_sentinel_url(settings.redis_url)
    sentinel = SyncSentinel(list(address.sentinels),
                            sentinel_kwargs=sentinel_connection_kwargs(settings, address, data_kwargs))
    kw = dict(data_kwargs, db=address.db, retry=retry)
    if address.tls:
        kw["ssl"] = True
    return sentinel.master_for(address.master, **kw)


async def leave_demoted_primary(client: Any, refusals: list[str]) -> None:
    """After a refusal that says the server is a replica (a script's per-item READONLY, which a
    script answers as a value, not an error reply, so redis-py does not see it; WAIT's "cannot be
    used with replica instances"): a Sentinel client (or pipeline) drops its pool's connections,
    and the next ones ask the sentinels for the primary again. (The write is retried by its caller.)"""
    pool = getattr(client, "connection_pool", None)
    if isinstance(pool, SentinelConnectionPool) and any(
            r.startswith("READONLY") or ": READONLY" in r or "replica instances" in r for r in refusals):
        await pool.disconnect()
