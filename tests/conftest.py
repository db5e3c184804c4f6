"""Shared fixtures: one redis-server per test session, a fresh namespace per test."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import AsyncIterator, Iterator

import pytest

from redroll.embedded import RedisServer, start_redis_server
from shared.connection import connect
from shared.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: the delivery promises are tested against a real server "
                    "(apt-get install -y redis-server)")
    server = start_redis_server()
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
               REDROLL_MAX_DELIVERIES=str(settings.max_deliveries), PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def spawn(settings: Settings, *args: str, log: Path | None = None, **env: str) -> subprocess.Popen:
    """Run ``redroll ARGS`` as a real subprocess (``python -m redroll.cli``)."""
    out = open(log, "ab") if log else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, "-m", "redroll.cli", *args], cwd=ROOT,
                            env=redroll_env(settings, **env), stdout=out, stderr=subprocess.STDOUT)


async def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> None:
    """Await until ``predicate()`` (sync or async) is truthy, or fail."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)
