"""Process and server plumbing shared by the benchmark sections.

Everything runs against one private ``redis-server`` (no persistence, loopback port) that the
suite starts itself; every role (producer, worker, consumer, peers' processes) is a separate OS
process started in its own session and stopped by its process-group id, with the subprocess
helper and the poller the tests use (:mod:`tests.support`).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import redis

from redroll.testing.embedded import RedisServer, start_redis_server
from tests.support import poll, processes
from tests.support.processes import Proc, group_cpu_s, stop_processes

ROOT = Path(__file__).resolve().parents[1]
__all__ = ["BenchError", "Proc", "Procs", "Server", "group_cpu_s", "stop_processes", "wait_for"]


# ---------------------------------------------------------------- processes


class BenchError(RuntimeError):
    """A section could not produce its figures (a process died, a run timed out)."""


@dataclass
class Procs(processes.Procs):
    """The processes of one run (see :class:`tests.support.processes.Procs`): a death is a BenchError."""

    error: type[Exception] = BenchError


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, *, procs: Procs | None = None,
             allow_exited: Sequence[str] = (), interval: float = 0.02) -> Any:
    """Poll ``predicate`` until truthy (:func:`tests.support.poll.wait_for`); fail early when one of
    ``procs`` died."""
    check = (lambda: procs.check_alive(allow_exited=allow_exited)) if procs is not None else None
    return poll.wait_for(predicate, timeout, what, check=check, interval=interval, error=BenchError)


def read_json(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_json_atomic(path: str | Path, obj: Any) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


# ---------------------------------------------------------------- the server


PACKAGE_DIRS = ("redroll", "shared", "producer", "consumer", "engine_worker", "benchmarks")
"""The checkout's folders of Python code (redroll's packages and this suite)."""


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's soft limit on open files to its hard limit (what ``ulimit -n`` may go
    to without privileges); processes started afterwards inherit it. Returns (soft, hard)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def compile_checkout(root: Path = ROOT, names: tuple[str, ...] = PACKAGE_DIRS) -> None:
    """Byte-compile the checkout's modules into their ``__pycache__`` folders, as pip does when it
    installs a wheel. Under ``PYTHONDONTWRITEBYTECODE=1`` Python writes no ``.pyc`` files, so
    every process started from a checkout would compile every module it imports again: about
    60 ms for ``redroll submit`` here, which no installed redroll pays, and which the command
    line's figure (timed from the process's start) would count. Best effort: a read-only
    checkout stays as it is."""
    import compileall

    for name in names:
        compileall.compile_dir(root / name, quiet=2, workers=1)


class Server:
    """The suite's private redis-server and a sync client on it."""

    def __init__(self, executable: str | None = None) -> None:
        self.server: RedisServer = start_redis_server("--loglevel", "warning", executable=executable)
        self.url = self.server.url
        self.r = redis.Redis.from_url(self.url)

    def fresh(self) -> None:
        """Empty the server between runs (the suite owns it: nothing else lives there)."""
        self.r.flushall()
        self.r.script_flush()

    def cpu_s(self) -> float:
        info = self.r.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    def used_memory(self) -> int:
        return int(self.r.info("memory")["used_memory"])

    def version(self) -> str:
        return str(self.r.info("server")["redis_version"])

    def stop(self) -> None:
        try:
            self.r.close()
        finally:
            self.server.stop()
            shutil.rmtree(self.server.directory, ignore_errors=True)


# ---------------------------------------------------------------- environment


def redroll_env(server: Server, namespace: str, **extra: Any) -> dict[str, str]:
    env = {
        "REDROLL_REDIS_URL": server.url,
        "REDROLL_NAMESPACE": namespace,
        "REDROLL_LOG_LEVEL": "warning",
        "PYTHONPATH": str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""),
        "PYTHONUNBUFFERED": "1",
    }
    env.update({k: str(v) for k, v in extra.items()})
    return env


def new_namespace(section: str) -> str:
    return f"bench-{section}-{uuid.uuid4().hex[:6]}"


def new_run_dir(base: Path, name: str) -> Path:
    d = base / f"{name}-{uuid.uuid4().hex[:6]}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def make_base_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="redroll-bench-"))


def machine_info() -> dict[str, Any]:
    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gib = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    os_name = ""
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                os_name = line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    import importlib.metadata as md

    import msgpack

    try:
        hiredis_version = md.version("hiredis")
    except md.PackageNotFoundError:
        hiredis_version = "not installed"

    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model,
        "memory_gib": mem_gib,
        "os": os_name or platform.platform(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "redis_py": redis.__version__,
        "hiredis": hiredis_version,
        "msgpack": ".".join(map(str, msgpack.version)),
    }


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank-interpolated percentile (q in [0, 100])."""
    if not values:
        return float("nan")
    s = sorted(values)
    if len(s) == 1:
        return s[0]
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median_range(runs: Sequence[dict[str, Any]], keys: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    """Each figure of ``runs`` (``keys``; default: every key of the first run) as its median, min
    and max over the runs: how the benchmarks report three runs."""
    import statistics

    keys = list(runs[0]) if keys is None else keys
    return {k: {"median": statistics.median(r[k] for r in runs), "min": min(r[k] for r in runs),
                "max": max(r[k] for r in runs)} for k in keys}


def emit_json(result: Any, json_out: str | None) -> None:
    """Print a bench's JSON document, and write it to ``json_out`` too when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if json_out:
        Path(json_out).write_text(text + "\n")
