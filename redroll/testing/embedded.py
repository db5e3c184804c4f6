"""A Redis to run against with no setup: a private redis-server, else in-process fakeredis."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    """A redis-server process on a loopback port, owned by this process."""

    port: int
    process: subprocess.Popen
    directory: str

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def answers_ping(port: int) -> bool:
    """True when a plain-text server on loopback ``port`` answers PING (PONG, or NOAUTH from a
    server that wants a password)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64)[:1] in (b"+", b"-")
    except OSError:
        return False


def start_redis_server(*extra: str, port: int | None = None, directory: str | None = None,
                       executable: str | None = None, timeout: float = 10.0, port_option: str = "--port",
                       ready: Callable[[int], bool] = answers_ping) -> RedisServer:
    """Start ``redis-server`` (no persistence unless ``extra`` asks for it) and wait until
    ``ready(port)``.

    ``port_option``: the option ``port`` is served under; another one than ``--port`` (e.g.
    ``--tls-port``) also closes the plain-text port, and then wants its own ``ready`` probe.
    """
    exe = executable or shutil.which("redis-server") or shutil.which("valkey-server")
    if exe is None:
        raise FileNotFoundError("redis-server is not installed")
    port = port or free_port()
    directory = directory or tempfile.mkdtemp(prefix="redroll-redis-")
    listen = ["--port", str(port)] if port_option == "--port" else ["--port", "0", port_option, str(port)]
    args = [exe, *listen, "--bind", "127.0.0.1", "--dir", directory, "--save", "",
            "--appendonly", "no", "--protected-mode", "no", *extra]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with code {proc.returncode}: {' '.join(args)}")
        if ready(port):
            return RedisServer(port, proc, directory)
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"redis-server did not answer on port {port} within {timeout}s")


@dataclass
class RedisCluster:
    """A Redis Cluster of redis-server processes on loopback ports, owned by this process."""

    nodes: list[RedisServer]
    """Primaries first (in slot order), then replicas."""
    primaries: int

    @property
    def url(self) -> str:
        """A seed URL: the cluster client discovers the other nodes from it."""
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        for node in self.nodes:
            shutil.rmtree(node.directory, ignore_errors=True)


def start_redis_cluster(primaries: int = 3, *extra: str, replicas: int = 0, executable: str | None = None,
                        timeout: float = 30.0) -> RedisCluster:
    """Start ``primaries`` cluster-enabled servers, give each an equal share of the 16384 slots,
    join them (CLUSTER MEET), add ``replicas`` replicas (of the first primaries, one each, in
    turn) and wait until every node reports ``cluster_state:ok``."""
    import redis

    total = primaries + replicas
    started: list[RedisServer] = []
    bus_ports: list[int] = []
    clients: list[redis.Redis] = []
    try:
        for _ in range(total):
            bus_ports.append(free_port())  # explicit: the default (port + 10000) may be taken or past 65535
            directory = tempfile.mkdtemp(prefix="redroll-cluster-")
            started.append(start_redis_server("--cluster-enabled", "yes", "--cluster-config-file",
                                              "nodes.conf", "--cluster-port", str(bus_ports[-1]),
                                              "--cluster-node-timeout", "5000",
                                              *extra, directory=directory, executable=executable))
        clients = [redis.Redis(port=n.port, decode_responses=True) for n in started]
        bounds = [round(i * 16384 / primaries) for i in range(primaries + 1)]
        for client, lo, hi in zip(clients, bounds, bounds[1:]):
            client.execute_command("CLUSTER ADDSLOTS", *range(lo, hi))
        for node, bus in zip(started[1:], bus_ports[1:]):
            clients[0].execute_command("CLUSTER MEET", "127.0.0.1", node.port, bus)
        deadline = time.monotonic() + timeout

        def wait_for(what: str, ready: Any) -> None:
            while not ready():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis cluster: {what} not done within {timeout}s")
                time.sleep(0.1)

        wait_for("join", lambda: all(int(c.cluster("INFO").get("cluster_known_nodes", 0)) == total
                                     for c in clients))
        for i, replica in enumerate(clients[primaries:]):
            primary_id = clients[i % primaries].cluster("MYID")
            replica.execute_command("CLUSTER REPLICATE", primary_id)
        wait_for("replication", lambda: all(c.info("replication").get("master_link_status") == "up"
                                            for c in clients[primaries:]))
        wait_for("slot coverage", lambda: all(c.cluster("INFO").get("cluster_state") == "ok" for c in clients))
        return RedisCluster(started, primaries)
    except BaseException:
        RedisCluster(started, primaries).stop()
        raise
    finally:
        for c in clients:
            c.close()


@contextlib.contextmanager
def embedded_redis() -> Iterator[tuple[str, str]]:
    """Yield (url, description): REDROLL_REDIS_URL if set, else a private redis-server, else fakeredis."""
    url = os.environ.get("REDROLL_REDIS_URL")
    if url:
        yield url, "REDROLL_REDIS_URL"
        return
    if shutil.which("redis-server"):
        server = start_redis_server()
        try:
            yield server.url, f"private redis-server on port {server.port}"
        finally:
            server.stop()
            shutil.rmtree(server.directory, ignore_errors=True)
        return
    from fakeredis import TcpFakeServer

    port = free_port()
    fake = TcpFakeServer(("127.0.0.1", port), server_type="redis")
    thread = threading.Thread(target=fake.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"redis://127.0.0.1:{port}/0", f"in-process fakeredis on port {port} (no redis-server installed)"
    finally:
        fake.shutdown()
        fake.server_close()
