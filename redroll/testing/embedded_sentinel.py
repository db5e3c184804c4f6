"""A Sentinel-managed Redis on loopback ports: a primary, its replicas and three sentinels (tests,
benchmarks, trying a failover by hand)."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from redroll.testing.embedded import RedisServer, answers_ping, free_port, start_redis_server


@dataclass
class SentinelGroup:
    """Data nodes (the first started as primary) watched by sentinels, all owned by this process."""

    nodes: list[RedisServer]
    sentinels: list[RedisServer]
    master: str
    executable: str | None = None
    extra: tuple[str, ...] = ()
    killed: list[int] = field(default_factory=list)
    """Ports of data nodes SIGKILLed by :meth:`kill_primary` and not restarted."""
    proxies: list["DelayProxy"] = field(default_factory=list)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.master}/0"

    def primary_port(self) -> int:
        """The primary's port as the sentinels (a majority of those that answer) report it."""
        votes: dict[int, int] = {}
        for s in self.sentinels:
            try:
                with redis.Redis(port=s.port, socket_timeout=1, decode_responses=True) as c:
                    _host, port = c.sentinel_get_master_addr_by_name(self.master)
                    votes[int(port)] = votes.get(int(port), 0) + 1
            except (redis.RedisError, OSError, TypeError):
                continue
        if not votes:
            raise RuntimeError("no sentinel answers")
        return max(votes, key=lambda p: votes[p])

    def node(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def kill_primary(self) -> int:
        """SIGKILL the primary (no shutdown, no last write to its replicas); returns its port."""
        port = self.primary_port()
        node = self.node(port)
        os.kill(node.process.pid, signal.SIGKILL)
        node.process.wait()
        self.killed.append(port)
        return port

    def wait_for_failover(self, old_port: int, timeout: float = 60.0) -> int:
        """Wait until every sentinel names another primary than ``old_port`` and that node takes
        writes; returns its port."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                port = self.primary_port()
                if port != old_port and all(self._names(s.port) == port for s in self.sentinels):
                    with redis.Redis(port=port, socket_timeout=1) as c:
                        if c.info("replication").get("role") == "master":
                            return port
            except (redis.RedisError, OSError, RuntimeError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"no failover away from port {old_port} within {timeout}s")

    def _names(self, sentinel_port: int) -> int | None:
        with redis.Redis(port=sentinel_port, socket_timeout=1, decode_responses=True) as c:
            addr = c.sentinel_get_master_addr_by_name(self.master)
            return int(addr[1]) if addr else None

    def restart(self, port: int, timeout: float = 30.0) -> None:
        """Start a killed node again on its port, empty, as a replica of the current primary (as a
        supervisor restarting it would, and as the sentinels would make it), and wait until it is
        in sync."""
        old = self.node(port)
        primary = self.primary_port()
        server = start_redis_server("--replicaof", "127.0.0.1", str(primary), *self.extra, port=port,
                                    directory=old.directory, executable=self.executable)
        self.nodes[self.nodes.index(old)] = server
        self.killed.remove(port)
        deadline = time.monotonic() + timeout
        with redis.Redis(port=port, socket_timeout=1) as c:
            while c.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"restarted node {port} did not sync within {timeout}s")
                time.sleep(0.05)

    def stop(self) -> None:
        for proxy in self.proxies:
            proxy.close()
        for server in [*self.sentinels, *self.nodes]:
            server.stop()
        for server in [*self.sentinels, *self.nodes]:
            shutil.rmtree(server.directory, ignore_errors=True)


def start_sentinel_group(replicas: int = 1, sentinels: int = 3, *extra: str, master: str = "mymaster",
                         down_after_ms: int = 1000, failover_timeout_ms: int = 5000,
                         executable: str | None = None, timeout: float = 30.0,
                         replica_delay_ms: float = 0) -> SentinelGroup:
    """Start a primary, ``replicas`` replicas of it and ``sentinels`` sentinels (quorum: a
    majority) that fail over ``down_after_ms`` after the primary stops answering. Returns once the
    replicas are in sync and every sentinel knows every replica and the other sentinels.

    ``replica_delay_ms`` > 0: each replica reads the replication stream through a proxy that
    hands it on that much later (a replica behind its primary, as across zones); what the proxy
    holds when the primary dies never reaches the replica. (The failover timeout is then at least
    20 s: a sentinel points a replica whose master is not the primary it knows at the primary
    directly, bypassing the proxy, once that has lasted the failover timeout.)"""
    nodes: list[RedisServer] = []
    watchers: list[RedisServer] = []
    extra = ("--repl-diskless-sync-delay", "0", *extra)  # (a replica syncs at once, not after 5 s)
    group = SentinelGroup(nodes, watchers, master, executable, tuple(extra))
    if replica_delay_ms:
        failover_timeout_ms = max(failover_timeout_ms, 20_000)
    try:
        nodes.append(start_redis_server(*extra, executable=executable))
        primary = nodes[0].port
        for _ in range(replicas):
            upstream = primary
            if replica_delay_ms:
                group.proxies.append(DelayProxy(primary, replica_delay_ms / 1000))
                upstream = group.proxies[-1].port
            nodes.append(start_redis_server("--replicaof", "127.0.0.1", str(upstream), *extra,
                                            executable=executable))
        deadline = time.monotonic() + timeout
        _wait(lambda: all(_link_up(n.port) for n in nodes[1:]), "replication", deadline)
        for _ in range(sentinels):
            watchers.append(_start_sentinel(primary, master, sentinels // 2 + 1, down_after_ms,
                                            failover_timeout_ms, executable))
        _wait(lambda: all(_sentinel_sees(s.port, master, replicas, sentinels - 1) for s in watchers),
              "sentinel discovery", deadline)
        return group
    except BaseException:
        group.stop()
        raise


def _start_sentinel(primary: int, master: str, quorum: int, down_after_ms: int, failover_timeout_ms: int,
                    executable: str | None) -> RedisServer:
    exe = executable or shutil.which("redis-server") or shutil.which("valkey-server")
    if exe is None:
        raise FileNotFoundError("redis-server is not installed")
    port = free_port()
    directory = tempfile.mkdtemp(prefix="redroll-sentinel-")
    conf = Path(directory) / "sentinel.conf"  # (a sentinel rewrites its config file: it must be its own)
    conf.write_text(f"port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {directory}\n"
                    f"sentinel monitor {master} 127.0.0.1 {primary} {quorum}\n"
                    f"sentinel down-after-milliseconds {master} {down_after_ms}\n"
                    f"sentinel failover-timeout {master} {failover_timeout_ms}\n"
                    f"sentinel parallel-syncs {master} 1\n")
    proc = subprocess.Popen([exe, str(conf), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not answers_ping(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"sentinel on port {port} did not start (exit code {proc.poll()})")
        time.sleep(0.05)
    return RedisServer(port, proc, directory)


def _link_up(port: int) -> bool:
    with redis.Redis(port=port, socket_timeout=1) as c:
        return c.info("replication").get("master_link_status") == "up"


def _sentinel_sees(port: int, master: str, replicas: int, others: int) -> bool:
    with redis.Redis(port=port, socket_timeout=1, decode_responses=True) as c:
        state = c.sentinel_master(master)
        return int(state.get("num-slaves", 0)) >= replicas and int(state.get("num-other-sentinels", 0)) >= others


def _wait(ready, what: str, deadline: float) -> None:
    while True:
        try:
            if ready():
                return
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"sentinel group: {what} not done in time")
        time.sleep(0.1)


class DelayProxy:
    """A TCP proxy on a loopback port to ``upstream``: what upstream sends reaches the client
    ``delay_s`` later, what the client sends goes at once. When upstream closes, the client's
    connection closes at once too, and what was still held is dropped."""

    def __init__(self, upstream: int, delay_s: float):
        self.upstream, self.delay_s = upstream, delay_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                continue
            held: queue.Queue = queue.Queue()
            threading.Thread(target=self._read_upstream, args=(server, client, held), daemon=True).start()
            threading.Thread(target=self._hand_on, args=(client, held), daemon=True).start()
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _read_upstream(self, server: socket.socket, client: socket.socket, held: queue.Queue) -> None:
        try:
            while data := server.recv(65536):
                held.put((time.monotonic() + self.delay_s, data))
        except OSError:
            pass
        held.put(None)
        _shut(client)  # (upstream gone: what is held never arrives)
        _shut(server)

    @staticmethod
    def _hand_on(client: socket.socket, held: queue.Queue) -> None:
        while (item := held.get()) is not None:
            due, data = item
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                client.sendall(data)
            except OSError:
                return

    @staticmethod
    def _pump(client: socket.socket, server: socket.socket) -> None:
        try:
            while data := client.recv(65536):
                server.sendall(data)
        except OSError:
            pass
        _shut(server)

    def close(self) -> None:
        self._closed = True
        _shut(self._listener)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
