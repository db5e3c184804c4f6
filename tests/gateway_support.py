"""Shared by the gateway tests and benchmark: ``redroll serve`` as a real subprocess, and
synthetic workers that count what they generate."""

from __future__ import annotations

import collections
import socket
import subprocess
import time
from pathlib import Path

import httpx

from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.shared.settings import Settings
from tests.conftest import spawn


class CountingEngine(SyntheticEngine):
    """The synthetic engine, counting the generations it started per request_id."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.started: collections.Counter[str] = collections.Counter()
        self.affinity: dict[str, str | None] = {}

    def _count(self, request) -> None:
        self.started[request.request_id] += 1
        self.affinity[request.request_id] = request.affinity_key

    async def generate(self, request, handle):
        if not self.instant:  # (an instant engine's generate calls generate_now, which counts)
            self._count(request)
        return await super().generate(request, handle)

    def generate_now(self, request):
        self._count(request)
        return super().generate_now(request)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """One ``redroll serve`` process on a free port of localhost."""

    def __init__(self, settings: Settings, *flags: str, log: Path | None = None, healthy: bool = True,
                 **env: str):
        """Started, and (``healthy``) answering 200 on /health; else only answering at all."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen = spawn(settings, "serve", "--port", str(self.port), *flags, log=log,
                                             **env)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redroll serve exited with {self.proc.returncode}"
                                   + (f": {log.read_text()[-2000:]}" if log else ""))
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == (200 if healthy else 503):
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("redroll serve did not become healthy in 60 s")
            time.sleep(0.1)

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
