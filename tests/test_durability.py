"""Sentinel URLs and the replicated-durability setting (wait_replicas), on plain servers.

The failover itself (sentinels, a killed primary) is in test_sentinel_failover.py."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import redis

from redroll.producer.client import make_request, submit_batch
from redroll.shared.connection import RedisConfigError, connect, reach, redact
from redroll.shared.connection.durability import Durability, ReplicasBehindError
from redroll.shared.connection.sentinel import parse_sentinel_url, sentinel_connection_kwargs
from redroll.shared.scripts import Scripts
from redroll.shared.settings import Settings
from redroll.testing.embedded import start_redis_server

from .conftest import start_test_server

# ---------------------------------------------------------------- the redis+sentinel:// URL

def test_sentinel_url_names_sentinels_master_db_and_tls():
    a = parse_sentinel_url("redis+sentinel://s1:26380,s2,[::1]:26381/prod-master/3")
    assert a.sentinels == (("s1", 26380), ("s2", 26379), ("::1", 26381))
    assert (a.master, a.db, a.tls) == ("prod-master", 3, False)
    b = parse_sentinel_url("rediss+sentinel://10.0.0.1:5000/m")
    assert (b.sentinels, b.master, b.db, b.tls) == ((("10.0.0.1", 5000),), "m", 0, True)


@pytest.mark.parametrize("url,words", [
    ("redis+sentinel://user:secret@s1:26379/m", "carries no credentials"),
    ("redis+sentinel://s1:26379", "must name the master"),
    ("redis+sentinel://s1:26379/", "must name the master"),
    ("redis+sentinel://s1:26379/m/zero", "is not a number"),
    ("redis+sentinel://s1:notaport/m", "no valid port"),
    ("redis+sentinel://s1:26379,,s2/m", "empty sentinel address"),
])
def test_a_sentinel_url_that_cannot_work_is_refused_in_one_line(url, words):
    with pytest.raises(RedisConfigError, match=words) as info:
        parse_sentinel_url(url)
    assert "secret" not in str(info.value) and "\n" not in str(info.value)


def test_redact_hides_anything_before_the_at_of_a_sentinel_url():
    assert redact("redis+sentinel://u:pw@s1:1,s2:2/m") == "redis+sentinel://***@s1:1,s2:2/m"
    assert redact("redis+sentinel://s1:1,s2:2/m/1") == "redis+sentinel://s1:1,s2:2/m/1"


def test_sentinel_credentials_and_tls_come_from_their_own_settings(tmp_path):
    secret = tmp_path / "sentinel.pw"
    secret.write_text("s3cret\n")
    settings = Settings.from_env({"REDROLL_REDIS_URL": "rediss+sentinel://s1/m", "REDROLL_REDIS_PASSWORD": "data",
                                  "REDROLL_SENTINEL_USERNAME": "watcher",
                                  "REDROLL_SENTINEL_PASSWORD_FILE": str(secret),
                                  "REDROLL_TLS_CA_FILE": "/ca.pem"})
    data_kw = {"password": "data", "socket_timeout": 30, "ssl_ca_certs": "/ca.pem"}
    kw = sentinel_connection_kwargs(settings, parse_sentinel_url(settings.redis_url), data_kw)
    assert kw["username"] == "watcher" and kw["password"] == "s3cret"  # not the primary's password
    assert kw["ssl"] is True and kw["ssl_ca_certs"] == "/ca.pem" and kw["socket_timeout"] == 30


def test_durability_settings_read_from_env_and_checked():
    s = Settings.from_env({"REDROLL_WAIT_REPLICAS": "2", "REDROLL_WAIT_TIMEOUT_MS": "250", "REDROLL_WAIT_AOF": "1"})
    assert Durability.of(s) == Durability(2, 250, True)
    assert Durability.of(s).command() == ("WAITAOF", 1, 2, 250)
    assert Durability(1, 100).command() == ("WAIT", 1, 100)
    with pytest.raises(ValueError, match="wait_timeout_ms"):
        Settings(wait_timeout_ms=0)  # (WAIT 0 would block for ever)
    with pytest.raises(ValueError, match="not with redis_cluster"):
        Settings(wait_replicas=1, redis_cluster=True)


def test_checked_strips_the_wait_and_refuses_a_shortfall():
    d = Durability(2, 100)
    assert d.checked([[1], [2], 2]) == [[1], [2]]
    with pytest.raises(ReplicasBehindError, match="1 of 2 replica") as info:
        d.checked([[1], 1])
    assert isinstance(info.value, redis.ConnectionError)  # every write path retries it as a lost connection
    failed = redis.ResponseError("NOSCRIPT")
    assert d.checked([failed, 0]) == [failed]  # the write's own error is its caller's to raise
    assert Durability().checked([[1]]) == [[1]]  # off: nothing added, nothing taken
    aof = Durability(1, 100, aof=True)
    assert aof.checked([[1], [1, 1]]) == [[1]]
    with pytest.raises(ReplicasBehindError):
        aof.checked([[1], [0, 1]])  # not fsynced on the primary


# ---------------------------------------------------------------- WAIT against real servers

@pytest.fixture
def primary_and_replica():
    primary = start_test_server("--repl-diskless-sync-delay", "0")  # (a replica syncs at once, not after 5 s)
    replica = start_test_server("--replicaof", "127.0.0.1", str(primary.port))
    yield primary, replica
    for server in (replica, primary):
        server.stop()
        shutil.rmtree(server.directory, ignore_errors=True)


async def _in_sync(replica_port: int) -> None:
    c = redis.asyncio.Redis(port=replica_port)
    try:
        for _ in range(200):
            if (await c.info("replication")).get("master_link_status") == "up":
                return
            await asyncio.sleep(0.05)
        raise AssertionError("replica did not sync")
    finally:
        await c.aclose()


async def test_a_submit_no_replica_confirmed_is_not_accepted_and_its_retry_is_recognised(primary_and_replica,
                                                                                          namespace):
    primary, replica = primary_and_replica
    await _in_sync(replica.port)
    # (generous timeouts where the replica is there: a loaded machine may take a while to answer)
    settings = Settings(redis_url=primary.url, namespace=namespace, wait_replicas=1, wait_timeout_ms=5000)
    r = connect(settings)
    scripts = Scripts(r)
    try:
        req = make_request(request_id="r1", prompt="p")
        item = (req, b"payload", "token-1")
        (reply,) = await submit_batch(r, scripts, settings, [item])
        assert int(reply[0]) == 1  # written and on the replica: accepted
        # The replica goes away: the next submit is written on the primary but not acknowledged.
        await redis.asyncio.Redis(port=replica.port).replicaof("NO", "ONE")
        req2 = make_request(request_id="r2", prompt="p")
        with pytest.raises(ReplicasBehindError, match="0 of 1 replica"):
            await submit_batch(r, scripts, settings.with_(wait_timeout_ms=200), [(req2, b"payload", "token-2")])
        # The replica is back: the same submit sent again (same token) is recognised, not doubled.
        await redis.asyncio.Redis(port=replica.port).replicaof("127.0.0.1", primary.port)
        await _in_sync(replica.port)
        (again,) = await submit_batch(r, scripts, settings, [(req2, b"payload", "token-2")])
        assert int(again[0]) == 2
        assert await r.xlen(settings.keys.requests) == 2
    finally:
        await r.aclose()


async def test_the_consumer_ack_transaction_waits_and_raises_what_the_multi_refused(primary_and_replica,
                                                                                    namespace):
    primary, replica = primary_and_replica
    await _in_sync(replica.port)
    r = connect(Settings(redis_url=primary.url))
    try:
        d = Durability(1, 5000)

        def fill(pipe):
            pipe.sadd(f"{namespace}:set", "a", "b")
            pipe.expireat(f"{namespace}:set", 4_000_000_000)

        assert await d.transaction(r, fill) == [2, True]
        assert await redis.asyncio.Redis(port=replica.port).scard(f"{namespace}:set") == 2  # WAIT: already there
        await r.set(f"{namespace}:str", "x")
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            await d.transaction(r, lambda pipe: pipe.sadd(f"{namespace}:str", "a"))
        with pytest.raises(ReplicasBehindError):
            await Durability(2, 100).transaction(r, fill)  # one replica of the two asked
    finally:
        await r.aclose()


async def test_a_gateways_keyed_submit_waits_for_the_replicas_and_its_retry_is_not_doubled(primary_and_replica,
                                                                                               namespace):
    """``redroll serve``'s Idempotency-Key calls submit in a WATCH/MULTI of their own: with
    wait_replicas they, too, are done only once a replica has them, and the retry of one that was
    not (the client's, with the same key) submits nothing twice."""
    pytest.importorskip("starlette")
    from redroll.producer.keyed import KeyedCalls
    from redroll.shared.scripts import Scripts

    primary, replica = primary_and_replica
    await _in_sync(replica.port)
    settings = Settings(redis_url=primary.url, namespace=namespace, wait_replicas=1, wait_timeout_ms=5000)
    r = connect(settings)
    calls = KeyedCalls(settings, r, Scripts(r), r, window_s=60)
    try:
        call = await calls.start([make_request(request_id="k-1", prompt="p")], "i-one", "fp")
        await call.close()
        assert await redis.asyncio.Redis(port=replica.port).xlen(settings.keys.requests) == 1  # WAIT: there
        await redis.asyncio.Redis(port=replica.port).replicaof("NO", "ONE")
        short = KeyedCalls(settings.with_(wait_timeout_ms=200), r, Scripts(r), r, window_s=60)
        with pytest.raises(ReplicasBehindError, match="0 of 1 replica"):
            await short.start([make_request(request_id="k-2", prompt="p")], "i-two", "fp")
        await redis.asyncio.Redis(port=replica.port).replicaof("127.0.0.1", primary.port)
        await _in_sync(replica.port)
        call = await calls.start([make_request(request_id="k-2", prompt="p")], "i-two", "fp")  # the retry
        await call.close()
        assert await r.xlen(settings.keys.requests) == 2
        assert await redis.asyncio.Redis(port=replica.port).xlen(settings.keys.requests) == 2
    finally:
        await r.aclose()


async def test_a_wait_that_reaches_a_replica_is_a_connection_error(primary_and_replica):
    """A connection left on a demoted primary: the wait (WAIT refuses to run on a replica) raises a
    connection error, which every write path retries (a Sentinel client's pool is dropped first)."""
    _primary, replica = primary_and_replica
    r = connect(Settings(redis_url=replica.url))
    try:
        async with r.pipeline(transaction=False) as pipe:
            pipe.get("anything")
            with pytest.raises(redis.ConnectionError, match="demoted to a replica"):
                await Durability(1, 100).execute(pipe)
    finally:
        await r.aclose()


async def test_wait_aof_is_refused_at_start_where_the_server_cannot_honour_it(redis_server, namespace):
    settings = Settings(redis_url=redis_server.url, namespace=namespace, wait_aof=True)
    r = connect(settings)
    try:
        version = (await r.info("server"))["redis_version"]
        # Redis 7.0 has no WAITAOF; a 7.2+ or Valkey server has it, but this one runs without appendonly.
        with pytest.raises(RedisConfigError, match=r"wait_aof \(REDROLL_WAIT_AOF\) needs WAITAOF"):
            await reach(r, settings)
        assert version
    finally:
        await r.aclose()


async def test_wait_aof_acknowledges_a_submit_fsynced_where_the_server_has_it(tmp_path, namespace):
    exe = shutil.which("valkey-server")
    if exe is None:
        pytest.skip("valkey-server (a server with WAITAOF) is not installed")
    server = start_redis_server("--appendonly", "yes", executable=exe, directory=str(tmp_path))
    settings = Settings(redis_url=server.url, namespace=namespace, wait_aof=True, wait_timeout_ms=500)
    r = connect(settings)
    try:
        await reach(r, settings)  # accepted: WAITAOF exists and appendonly is on
        (reply,) = await submit_batch(r, Scripts(r), settings,
                                      [(make_request(request_id="a1", prompt="p"), b"x", "t1")])
        assert int(reply[0]) == 1
    finally:
        await r.aclose()
        server.stop()
