"""The TRL tests: TRL's trainers, unmodified, generating through real ``redroll worker`` processes.

They need the ``trl`` extra (TRL needs Python 3.11+); where it is not installed this folder is not
collected. One fleet serves the session: a Redis namespace, the tiny policy's directory (built
in code by ``examples/trl_grpo.py``) and two transformers workers that load it. Every run pushes
its own weights first, so runs share the fleet without seeing each other's.
"""

from __future__ import annotations

import importlib.util
import subprocess
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from redroll.shared.settings import Settings
from tests.conftest import redroll_env, spawn, stop_process
from tests.support.poll import wait_until

if importlib.util.find_spec("trl") is None:
    collect_ignore_glob = ["test_*.py"]

WORKERS = 2


class Fleet:
    def __init__(self, settings: Settings, model_dir: Path, procs: list[subprocess.Popen], logs: Path):
        self.settings = settings
        self.model_dir = model_dir
        self.procs = procs
        self.logs = logs

    def env(self, **extra: str) -> dict[str, str]:
        """A trainer process's environment: this fleet's REDROLL_* settings."""
        return redroll_env(self.settings, TRL_EXPERIMENTAL_SILENCE="1", **extra)

    def tails(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(self.logs.glob("*.log")))


@pytest.fixture(scope="session")
def trl_fleet(redis_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from examples.trl_grpo import save_model

    root = tmp_path_factory.mktemp("trl")
    model_dir = root / "tiny-policy"
    save_model(str(model_dir), seed=0)
    settings = Settings(redis_url=redis_server.url, namespace="trl" + uuid.uuid4().hex[:10], heartbeat_s=0.5)
    procs = [spawn(settings, "worker", "--engine", "transformers", "--model-path", str(model_dir),
                   "--max-inflight", "64", "--max-batch-size", "64", log=root / f"worker{i}.log")
             for i in range(WORKERS)]
    fleet = Fleet(settings, model_dir, procs, root)
    try:
        import asyncio

        from redroll.ops.control import live_workers
        from redroll.shared.connection import connect

        async def started() -> None:
            r = connect(settings)
            try:
                def died() -> None:
                    if any(p.poll() is not None for p in procs):
                        raise AssertionError(f"a worker exited:\n{fleet.tails()}")

                await wait_until(lambda: _count(r, settings, live_workers), timeout=120, interval=0.2,
                                 what=f"{WORKERS} live workers", check=died)
            finally:
                await r.aclose()

        asyncio.run(started())
        yield fleet
    finally:
        for proc in procs:
            stop_process(proc)


async def _count(r, settings: Settings, live_workers) -> bool:
    return len(await live_workers(r, settings.keys)) == WORKERS
