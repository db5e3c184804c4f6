"""Redis connections from a URL: redis://, rediss:// (TLS), unix://, with ACL user and password."""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio

from redroll.shared.errors import ConnectionUnavailableError

try:
    import hiredis
except ImportError:  # redis-py works without it, only slower
    hiredis = None  # type: ignore[assignment]
from redis.asyncio.retry import Retry as AsyncRetry
from redis.asyncio.sentinel import MasterNotFoundError
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError as SyncMasterNotFoundError

from redroll.shared.connection.durability import Durability
from redroll.shared.connection.sentinel import (
    SENTINEL_SCHEMES,
    connect_sentinel,
    connect_sentinel_sync,
    credentials,
    is_sentinel_url,
    parse_sentinel_url,
    redact_sentinel_url,
)
from redroll.shared.errors import RedisConfigError
from redroll.shared.settings import Settings

T = TypeVar("T")


def redact(url: str) -> str:
    """The URL with any password replaced by ``***`` (for logs and errors)."""
    if is_sentinel_url(url):
        return redact_sentinel_url(url)
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    netloc = f"{user}:***@{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def connection_kwargs(settings: Settings) -> dict[str, Any]:
    url = settings.redis_url
    scheme = url.partition("://")[0]
    if scheme not in ("redis", "rediss", "unix", *SENTINEL_SCHEMES):
        raise RedisConfigError(f"redis URL {redact(url)!r} must start with redis://, rediss://, unix:// or "
                               "redis+sentinel:// (rediss+sentinel://)")
    # A read that hears nothing for socket_timeout raises (and is retried) instead of hanging on a
    # half-dead connection; it is well above the longest blocking read (1 s).
    kw: dict[str, Any] = {"decode_responses": False, "health_check_interval": 30, "socket_timeout": 30,
                          "socket_connect_timeout": 5}
    kw.update(credentials(settings.redis_username, settings.redis_password, settings.redis_password_file, "redis"))
    if scheme in ("rediss", "rediss+sentinel"):
        if settings.tls_ca_file:
            kw["ssl_ca_certs"] = settings.tls_ca_file
        if settings.tls_cert_file:
            kw["ssl_certfile"] = settings.tls_cert_file
        if settings.tls_key_file:
            kw["ssl_keyfile"] = settings.tls_key_file
    return kw


def _not_a_refused_login(is_retryable: Any) -> Any:
    """Wrap redis-py's retry predicate: a refused login is never retried (a wrong password will
    not get right), everything else as before."""
    def retryable(error: Exception) -> bool:
        if isinstance(error, redis.AuthenticationError):
            return False
        return is_retryable(error) if is_retryable is not None else True

    return retryable


class _AsyncRetry(AsyncRetry):
    async def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):  # type: ignore[override]
        return await super().call_with_retry(do, fail, _not_a_refused_login(is_retryable), with_failure_count)


class _SyncRetry(Retry):
    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):  # type: ignore[override]
        return super().call_with_retry(do, fail, _not_a_refused_login(is_retryable), with_failure_count)


LARGE_ARGUMENT_BYTES = 16 * 1024
"""Command arguments longer than this are sent as their own buffer (see :func:`large_argument`)."""


def large_argument(value: bytes) -> bytes | bytearray:
    """``value`` as a command argument, marked when it is large so that its command is sent with
    that argument as its own buffer instead of copied into one.

    ``hiredis.pack_command`` copies every argument into the packed command at about 1 ns a byte
    (0.4 ms for a 400 kB record, twenty times a plain copy); packing the rest in Python takes 20 µs
    for the same command. The mark is a bytearray: hiredis refuses one, so :class:`_HiredisPacking`
    packs that command itself and hands the argument to the socket as it is. (redis-py's own
    packer is not used for it: from 8.2 its asyncio connection packs with hiredis too, and turns a
    bytearray into bytes first, two copies.)
    """
    return bytearray(value) if len(value) > LARGE_ARGUMENT_BYTES else value


class _HiredisPacking:
    """Pack commands with hiredis (C) instead of redis-py's asyncio packer (pure Python).

    redis-py's sync client packs with hiredis when it is installed; its asyncio connection did not
    before 8.2. A 256-request ``finish_many`` call packs in about 135 µs instead of 990 µs. The
    bytes are the same (tested); a command hiredis cannot pack, among them those with a large
    argument :func:`large_argument` marked, is packed by :meth:`_pack_in_parts`.
    """

    def pack_command(self, *args: Any) -> list[bytes]:
        first = args[0]
        if isinstance(first, str):
            if " " in first:  # a multi-word command name ("CLIENT SETINFO"): separate arguments
                args = (*first.split(), *args[1:])
        elif b" " in first:
            args = (*first.split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]
        except TypeError:
            return self._pack_in_parts(args)

    def _pack_in_parts(self, args: tuple) -> list[Any]:
        """``args`` in the Redis protocol, each bytearray (a :func:`large_argument`) as a buffer of
        its own, the rest encoded by redis-py's encoder (which refuses what Redis cannot take)."""
        encode = self.encoder.encode  # type: ignore[attr-defined]
        parts: list[Any] = []
        head = b"*%d\r\n" % len(args)
        for arg in args:
            if type(arg) is bytearray:
                parts.append(head + b"$%d\r\n" % len(arg))
                parts.append(arg)
                head = b"\r\n"
            else:
                value = encode(arg)
                head = b"%s$%d\r\n%s\r\n" % (head, len(value), value)
        parts.append(head)
        return parts


_packing_classes: dict[type, type] = {}


def _with_hiredis_packing(connection_class: type) -> type:
    """``connection_class`` (plain, TLS or unix socket) with :class:`_HiredisPacking`."""
    if hiredis is None or issubclass(connection_class, _HiredisPacking):
        return connection_class
    if connection_class not in _packing_classes:
        _packing_classes[connection_class] = type(f"HiredisPacking{connection_class.__name__}",
                                                  (_HiredisPacking, connection_class), {})
    return _packing_classes[connection_class]


async def open_connections(r: Any, count: int) -> None:
    """Open ``count`` connections of ``r``'s pool now, with one PING each, sent at once.

    A pooled connection is opened on first use, and opening it is several round trips (connect,
    HELLO, CLIENT SETINFO), each waiting for the event loop. A worker opened its publisher's
    connection in the middle of its first batch: its first records reached Redis 50-70 ms after
    they were queued, a third of a 3,000-request run (15-25 ms with its connections opened at
    start). A cluster client opens its per-node pools as it learns the nodes: nothing is done."""
    if isinstance(r, redis.asyncio.RedisCluster):
        return
    await asyncio.gather(*(r.ping() for _ in range(count)))


async def reach(client: Any, settings: Settings) -> None:
    """The first command of a producer, worker or consumer: a PING. A Redis that cannot be reached
    (or refuses the login) raises :class:`~redroll.shared.errors.ConnectionUnavailableError`, one line
    naming the URL (:func:`describe_error`), the client's error chained."""
    try:
        await client.ping()
        await Durability.of(settings).check_server(client)
    except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.RedisClusterException, OSError) as exc:
        raise ConnectionUnavailableError(describe_error(exc, settings)) from exc


def connect(settings: Settings, max_connections: int = 64) -> redis.asyncio.Redis:
    """An asyncio client (hiredis parser when installed) that retries transient errors with backoff.

    The pool blocks (up to 20 s) for a free connection instead of failing under a burst. With
    ``settings.redis_cluster`` it is a :class:`redis.asyncio.RedisCluster` (see :func:`connect_cluster`).
    """
    if settings.redis_cluster:
        return connect_cluster(settings)  # type: ignore[return-value]
    kw = connection_kwargs(settings)
    retry = _AsyncRetry(ExponentialBackoff(cap=2.0, base=0.05), retries=5)
    if is_sentinel_url(settings.redis_url):
        return connect_sentinel(settings, kw, retry, max_connections, _with_hiredis_packing)
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        settings.redis_url, max_connections=max_connections, timeout=20, retry=retry, **kw)
    pool.connection_class = _with_hiredis_packing(pool.connection_class)
    client = redis.asyncio.Redis.from_pool(pool)  # the client owns (and closes) its pool
    client.retry = retry
    return client


def connect_cluster(settings: Settings) -> redis.asyncio.RedisCluster:
    """A Redis Cluster client seeded from ``settings.redis_url`` (any node).

    It follows MOVED/ASK redirections and, on connection errors or a failover, refreshes its slot
    map and retries (``retry``, then ``cluster_error_retry_attempts``). Every multi-key command,
    script and MULTI of redroll stays inside one hash tag, hence one slot.
    """
    kw = connection_kwargs(settings)
    if is_sentinel_url(settings.redis_url):
        raise RedisConfigError("Redis Sentinel serves one primary, not a cluster: drop redis_cluster "
                               "(REDROLL_REDIS_CLUSTER) or use a redis:// URL of a cluster node")
    if urlsplit(settings.redis_url).scheme == "unix":
        raise RedisConfigError("a Redis Cluster is reached over TCP: use a redis:// or rediss:// URL")
    retry = _AsyncRetry(ExponentialBackoff(cap=2.0, base=0.05), retries=5)
    client = redis.asyncio.RedisCluster.from_url(settings.redis_url, retry=retry, **kw)
    # Connections to the nodes it discovers are made with these arguments.
    node_kwargs = client.nodes_manager.connection_kwargs
    node_kwargs["connection_class"] = _with_hiredis_packing(node_kwargs.get("connection_class",
                                                                            redis.asyncio.Connection))
    return client


def is_cluster(client: Any) -> bool:
    """True for a Redis Cluster client (reads must then stay within one hash tag per call)."""
    return isinstance(client, redis.asyncio.RedisCluster)


def read_groups(client: Any, items: list[T]) -> list[list[T]]:
    """How to split reads over ``items`` (streams or partitions, each of one hash tag): one read
    over all of them, except on a cluster, where one read cannot span hash tags, so one each."""
    return [[item] for item in items] if is_cluster(client) else [items]


def connect_sync(settings: Settings) -> redis.Redis:
    kw = connection_kwargs(settings)
    retry = _SyncRetry(ExponentialBackoff(cap=2.0, base=0.05), retries=5)
    if is_sentinel_url(settings.redis_url) and not settings.redis_cluster:
        return connect_sentinel_sync(settings, kw, retry)
    client_class = redis.RedisCluster if settings.redis_cluster else redis.Redis
    return client_class.from_url(settings.redis_url, retry=retry, **kw)  # type: ignore[return-value]


_ACL_REFUSALS = ("NOPERM", "ACL failure in script", "user executing the script can't")
"""ACL refusals: NOPERM, and the ERR replies of a command refused inside a Lua script (Redis 7.0 /
Redis 7.2+ and Valkey), which redis-py raises as a plain ResponseError."""


def describe_error(exc: BaseException, settings: Settings) -> str:
    """One line an operator can act on."""
    url = redact(settings.redis_url)
    if isinstance(exc, redis.AuthenticationError) or "WRONGPASS" in str(exc) or "NOAUTH" in str(exc):
        return f"redis at {url} refused authentication: check REDROLL_REDIS_USERNAME / REDROLL_REDIS_PASSWORD ({exc})"
    if isinstance(exc, redis.exceptions.NoPermissionError) or any(m in str(exc) for m in _ACL_REFUSALS):
        user = settings.redis_username or urlsplit(settings.redis_url).username or "default"
        return f"redis at {url}: the ACL user {user!r} lacks a permission: {exc}"
    if "CERTIFICATE_VERIFY_FAILED" in str(exc):
        return (f"redis at {url}: its TLS certificate is not trusted (set REDROLL_TLS_CA_FILE to the CA that "
                f"signed it): {exc}")
    if "CERTIFICATE_REQUIRED" in str(exc):
        return (f"redis at {url} requires a TLS client certificate (set REDROLL_TLS_CERT_FILE and "
                f"REDROLL_TLS_KEY_FILE): {exc}")
    if isinstance(exc, (MasterNotFoundError, SyncMasterNotFoundError)):
        # (redis-py's message spells out every sentinel client; the last part is what failed)
        return (f"cannot reach redis at {url}: no sentinel names a primary "
                f"{parse_sentinel_url(settings.redis_url).master!r} (check the sentinels' addresses, the master "
                f"name and REDROLL_SENTINEL_USERNAME / REDROLL_SENTINEL_PASSWORD): {str(exc).rpartition(' - ')[2]}")
    if isinstance(exc, (redis.ConnectionError, OSError)):
        return f"cannot reach redis at {url}: {exc}"
    if isinstance(exc, RedisConfigError):
        return str(exc)
    return f"redis error at {url}: {type(exc).__name__}: {exc}"
