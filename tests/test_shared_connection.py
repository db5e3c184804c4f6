"""Client construction: hiredis command packing, the cluster client, the cluster setting."""

from __future__ import annotations

import pytest
import redis.asyncio
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection

from redroll.shared.connection import (
    LARGE_ARGUMENT_BYTES,
    RedisConfigError,
    _with_hiredis_packing,
    connect,
    is_cluster,
    large_argument,
    read_groups,
)
from redroll.shared.settings import Settings

COMMANDS = [
    ("SET", "k", "v"),
    ("EVALSHA", "a" * 40, 3, "{ns}:requests", b"{ns}:results", "{ns}:rid:x", 1.5, -7, 0, "ü", b"\x00\xff"),
    ("CLIENT SETINFO", "LIB-NAME", "redroll"),  # a two-word command name
    (b"CONFIG GET", "maxmemory"),
    ("XADD", "s", "*", "data", bytearray(b"abc"), "more", memoryview(b"xyz")),
    ("SET", "big", b"x" * 100_000),
    ("ZADD", "z", 10**30, "a", -0.0, "b", 1e20, "c", float("inf"), "d"),
]


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: str(a[0]))
def test_hiredis_packing_gives_redis_py_bytes(args):
    fast = _with_hiredis_packing(Connection)(host="localhost")
    plain = Connection(host="localhost")
    assert b"".join(fast.pack_command(*args)) == b"".join(plain.pack_command(*args))
    assert b"".join(fast.pack_commands([args, args])) == b"".join(plain.pack_commands([args, args]))


def test_a_large_argument_is_sent_as_its_own_buffer_with_the_same_bytes():
    # (hiredis would copy it into the packed command, at about 1 ns a byte)
    fast = _with_hiredis_packing(Connection)(host="localhost")
    plain = Connection(host="localhost")
    big = bytes(range(256)) * 2000
    small = b"x" * LARGE_ARGUMENT_BYTES
    assert large_argument(small) is small
    marked = large_argument(big)
    args = ("EVALSHA", "a" * 40, 1, "{ns}:results", 7, marked, "tail")
    packed = fast.pack_command(*args)
    assert any(chunk is marked for chunk in packed)
    assert b"".join(packed) == b"".join(plain.pack_command("EVALSHA", "a" * 40, 1, "{ns}:results", 7, big, "tail"))


def test_unpackable_arguments_fall_back_to_redis_py():
    fast = _with_hiredis_packing(Connection)(host="localhost")
    for bad in ({"a": 1}, None, True):
        with pytest.raises(redis.exceptions.DataError):  # redis-py's own refusal, not a hiredis TypeError
            fast.pack_command("SET", "k", bad)


@pytest.mark.parametrize("base", [Connection, SSLConnection, UnixDomainSocketConnection])
def test_every_connection_kind_gets_the_packer(base):
    cls = _with_hiredis_packing(base)
    assert issubclass(cls, base) and cls is _with_hiredis_packing(base) and _with_hiredis_packing(cls) is cls


async def test_connect_uses_the_packer_and_cluster_setting():
    plain = connect(Settings(redis_url="redis://127.0.0.1:1/0"))
    tls = connect(Settings(redis_url="rediss://127.0.0.1:1/0"))
    try:
        assert plain.connection_pool.connection_class.__name__ == "HiredisPackingConnection"
        assert issubclass(tls.connection_pool.connection_class, SSLConnection)
        assert not is_cluster(plain)
    finally:
        await plain.aclose()
        await tls.aclose()
    cluster = connect(Settings(redis_url="redis://127.0.0.1:1", redis_cluster=True))
    try:
        assert is_cluster(cluster) and isinstance(cluster, redis.asyncio.RedisCluster)
        assert cluster.nodes_manager.connection_kwargs["connection_class"].__name__ == "HiredisPackingConnection"
    finally:
        await cluster.aclose()
    with pytest.raises(RedisConfigError, match="TCP"):
        connect(Settings(redis_url="unix:///tmp/redis.sock", redis_cluster=True))


@pytest.mark.parametrize("raw,value", [("1", True), ("true", True), ("yes", True), ("0", False), ("off", False)])
def test_cluster_setting_from_env(raw, value):
    assert Settings.from_env({"REDROLL_REDIS_CLUSTER": raw}).redis_cluster is value


def test_cluster_setting_rejects_other_words():
    with pytest.raises(ValueError, match="REDROLL_REDIS_CLUSTER"):
        Settings.from_env({"REDROLL_REDIS_CLUSTER": "maybe"})


async def test_reads_are_split_per_hash_tag_only_on_a_cluster():
    plain = connect(Settings(redis_url="redis://127.0.0.1:1/0"))
    cluster = connect(Settings(redis_url="redis://127.0.0.1:1", redis_cluster=True))
    try:
        assert read_groups(plain, ["{a:0}:s", "{a:1}:s"]) == [["{a:0}:s", "{a:1}:s"]]
        assert read_groups(cluster, ["{a:0}:s", "{a:1}:s"]) == [["{a:0}:s"], ["{a:1}:s"]]
    finally:
        await plain.aclose()
        await cluster.aclose()


async def test_open_connections_opens_that_many_pooled_connections(settings, r):
    from redroll.shared.connection import connect, open_connections

    async def clients() -> int:
        return int((await r.info("clients"))["connected_clients"])

    client = connect(settings)
    before = await clients()
    try:
        await open_connections(client, 5)
        assert await clients() == before + 5
        await open_connections(client, 3)  # (a pool that has them uses them again)
        assert await clients() == before + 5
    finally:
        await client.aclose()
