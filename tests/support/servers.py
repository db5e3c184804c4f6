"""A redis-server that a test or harness crashes and starts again on the same port and directory
(AOF on, so what it acknowledged survives). Every server is started by
:func:`redroll.testing.embedded.start_redis_server`."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from redroll.testing.embedded import RedisServer, start_redis_server


class RestartableRedis:
    """A private redis-server with ``--appendonly yes --appendfsync <appendfsync>`` in
    ``directory``, restartable on the same port (each start logs to ``redis.<n>.log`` there)."""

    def __init__(self, directory: Path, appendfsync: str = "always", *extra: str, executable: str | None = None):
        self.directory = Path(directory)
        self.appendfsync = appendfsync
        self.extra = extra
        self.executable = executable
        self.server: RedisServer | None = None
        self.port: int | None = None
        self.starts = 0

    def _args(self) -> list[str]:
        logfile = self.directory / f"redis.{self.starts}.log"
        return ["--appendonly", "yes", "--appendfsync", self.appendfsync, "--logfile", str(logfile), *self.extra]

    def start(self) -> "RestartableRedis":
        self.directory.mkdir(parents=True, exist_ok=True)
        self.server = start_redis_server(*self._args(), port=self.port, directory=str(self.directory),
                                         executable=self.executable, timeout=30)
        self.port = self.server.port
        self.starts += 1
        return self

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def crash(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (SIGKILL: a crash; SIGTERM: a clean shutdown) and wait until it is gone."""
        assert self.server is not None, "not started"
        os.kill(self.server.process.pid, sig)
        self.server.process.wait()

    def crash_and_restart(self, down_s: float, sig: int = signal.SIGKILL) -> None:
        self.crash(sig)
        time.sleep(down_s)
        self.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def __enter__(self) -> "RestartableRedis":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
