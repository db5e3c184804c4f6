"""Shared fixtures: one redis-server per test session, a fresh namespace per test."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import pytest

from redroll.shared.connection import connect
from redroll.shared.settings import Settings
from redroll.testing.embedded import RedisServer, start_redis_server
from tests.support.poll import wait_until
from tests.support.processes import redroll_argv, start_process, stop_process

__all__ = ["read_jsonl", "redroll_env", "run_until_drained", "running", "spawn", "start_test_server", "started",
           "stop_process", "wait_until", "workers_and_consumer"]

ROOT = Path(__file__).resolve().parents[1]


TEST_SERVER_ENV = "REDROLL_TEST_SERVER"
"""Path or name of the server binary the suite runs against (default redis-server; e.g. valkey-server)."""


def server_executable() -> str:
    """The server binary under test: $REDROLL_TEST_SERVER, else redis-server (fails when missing)."""
    name = os.environ.get(TEST_SERVER_ENV) or "redis-server"
    exe = shutil.which(name)
    if exe is None:
        if name == "redis-server":
            pytest.fail("redis-server is not installed: the delivery promises are tested against a real server "
                        "(apt-get install -y redis-server)")
        pytest.fail(f"{TEST_SERVER_ENV}={name!r} is not an executable on PATH")
    return exe


def start_test_server(*extra: str, **kw) -> RedisServer:
    """``start_redis_server`` on the server under test, for tests that need a server of their own."""
    return start_redis_server(*extra, executable=server_executable(), **kw)


def pytest_configure(config: pytest.Config) -> None:
    """With $REDROLL_TEST_SERVER set, put a ``redis-server`` link to it first on PATH, so tests and
    subprocesses that start their own server by that name (reliability, chaos, bench, demo) run on
    the same server as the rest of the suite."""
    name = os.environ.get(TEST_SERVER_ENV)
    exe = shutil.which(name) if name else None
    if exe is None or os.path.basename(exe) == "redis-server":
        return
    shim = Path(tempfile.mkdtemp(prefix="redroll-test-server-"))
    (shim / "redis-server").symlink_to(exe)
    os.environ["PATH"] = f"{shim}{os.pathsep}{os.environ.get('PATH', '')}"
    config._redroll_server_shim = shim  # type: ignore[attr-defined]


def pytest_unconfigure(config: pytest.Config) -> None:
    shim = getattr(config, "_redroll_server_shim", None)
    if shim is not None:
        shutil.rmtree(shim, ignore_errors=True)


def pytest_report_header(config: pytest.Config) -> str:
    name = os.environ.get(TEST_SERVER_ENV) or "redis-server"
    exe = shutil.which(name)
    if exe is None:
        return f"test server: {name} (not found)"
    try:
        version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        version = f"version unknown: {exc}"
    return f"test server: {exe} ({version})"


@pytest.fixture(autouse=True)
def _root_logging_kept() -> Iterator[None]:
    """A test that runs the command line (``main([...])``) gets its logging set up: a handler on
    the stderr of that moment, which pytest closes after the test. The root logger's handlers and
    level are put back, so later tests' logs reach pytest's capture, not a closed stream."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = start_test_server()
    yield server
    server.stop()
    shutil.rmtree(server.directory, ignore_errors=True)


@pytest.fixture
def namespace() -> str:
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
def settings(redis_server: RedisServer, namespace: str) -> Settings:
    """Short timeouts so recovery paths run in test time."""
    return Settings(redis_url=redis_server.url, namespace=namespace, claim_idle_ms=1500, heartbeat_s=0.5,
                    drain_timeout_s=5.0, max_deliveries=3)


@pytest.fixture
async def r(settings: Settings) -> AsyncIterator:
    client = connect(settings)
    yield client
    await client.aclose()


def redroll_env(settings: Settings, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(REDROLL_REDIS_URL=settings.redis_url, REDROLL_NAMESPACE=settings.namespace,
               REDROLL_CLAIM_IDLE_MS=str(settings.claim_idle_ms), REDROLL_HEARTBEAT_S=str(settings.heartbeat_s),
               REDROLL_MAX_DELIVERIES=str(settings.max_deliveries),
               REDROLL_DRAIN_TIMEOUT_S=str(settings.drain_timeout_s), PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def spawn(settings: Settings, *args: str, log: Path | None = None, **env: str) -> subprocess.Popen:
    """Run ``redroll ARGS`` as a real subprocess (``python -m redroll.cli``), its output appended to
    ``log`` (default: discarded). Stop it with :func:`stop_process`."""
    return start_process(redroll_argv(*args), env=redroll_env(settings, **env), log=log)


def read_jsonl(path: Path) -> list[dict]:
    """The complete lines of a JSON-lines file that other processes are appending to (a line
    still being written, without its newline yet, is left for the next read)."""
    if not path.exists():
        return []
    text_ = path.read_text()
    complete = text_[: text_.rfind("\n") + 1]
    return [json.loads(x) for x in complete.splitlines() if x.strip()]


@contextlib.asynccontextmanager
async def started(engine: Any) -> AsyncIterator[Any]:
    """An engine started for the block and closed after it."""
    await engine.start()
    try:
        yield engine
    finally:
        await engine.close()


@contextlib.asynccontextmanager
async def running(*roles: Any) -> AsyncIterator[None]:
    """Run worker and consumer objects (``run`` / ``request_stop``) in this event loop for the
    block; on leaving it, ask each to stop and wait until each has drained and stopped."""
    tasks = [asyncio.create_task(x.run()) for x in roles]
    try:
        yield
    finally:
        for x in roles:
            x.request_stop()
        await asyncio.gather(*tasks)


async def run_until_drained(*roles: Any, timeout: float = 60.0) -> None:
    """Run workers and consumers in this event loop in burst mode until each has stopped on its own:
    nothing queued or claimed, nothing left for its group (see ``redroll.ops.backlog``). Waits
    on their own decision, not on a clock; fails after ``timeout`` seconds."""
    for role in roles:
        role.burst = True
    await asyncio.wait_for(asyncio.gather(*(role.run() for role in roles)), timeout)


def workers_and_consumer(settings: Settings, applied: list[str], workers: int = 2) -> tuple[list, Any]:
    """In-process roles for a pipeline test: ``workers`` synthetic-engine workers (16 in flight)
    and a consumer in group ``g`` whose handler ``h`` appends each record's request_id to ``applied``."""
    from redroll.consumer.runner import ConsumerRunner
    from redroll.engine_worker.engines.synthetic import SyntheticEngine
    from redroll.engine_worker.worker import Worker

    fleet = [Worker(settings, SyntheticEngine(), max_inflight=16, block_ms=200) for _ in range(workers)]
    consumer = ConsumerRunner(settings, group="g", handlers={"h": lambda rec: applied.append(rec.request_id)},
                              block_ms=200)
    return fleet, consumer
