"""Process and server plumbing shared by the benchmark sections.

Everything runs against one private ``redis-server`` (no persistence, loopback port) that the
suite starts itself; every role (producer, worker, consumer, peers' processes) is a separate OS
process started here in its own session, and stopped here by its process-group id.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import redis

from redroll.embedded import RedisServer, start_redis_server

ROOT = Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")


class BenchError(RuntimeError):
    """A section could not produce its figures (a process died, a run timed out)."""


# ---------------------------------------------------------------- processes


def group_cpu_s(pgid: int) -> float:
    """User+system CPU seconds of every live process in process group ``pgid``
    (plus what its waited-for children used)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                raw = fh.read().decode(errors="replace")
        except OSError:
            continue
        rest = raw[raw.rfind(")") + 2:].split()
        # rest[0] is field 3 (state); pgrp is field 5, utime..cstime are fields 14..17
        if int(rest[2]) != pgid:
            continue
        total += int(rest[11]) + int(rest[12]) + int(rest[13]) + int(rest[14])
    return total / CLK_TCK


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    cpu_s: float | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 30) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def sample_cpu(self) -> float:
        self.cpu_s = group_cpu_s(self.pid)
        return self.cpu_s


@dataclass
class Procs:
    """The processes of one run; stopped (SIGTERM, then SIGKILL to their own group) on exit."""

    run_dir: Path
    items: list[Proc] = field(default_factory=list)

    def spawn(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None,
              cwd: Path = ROOT) -> Proc:
        log = self.run_dir / f"{name}.log"
        fh = open(log, "ab")
        # nothing of the caller's REDROLL_* settings leaks into a run: each run says what it sets
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("REDROLL_")}
        full_env.update(env or {})
        popen = subprocess.Popen(list(argv), cwd=str(cwd), env=full_env, stdout=fh, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        fh.close()
        proc = Proc(name, popen, log)
        self.items.append(proc)
        return proc

    def check_alive(self, *, allow_exited: Sequence[str] = ()) -> None:
        for p in self.items:
            if p.name in allow_exited:
                if p.popen.poll() not in (None, 0):
                    raise BenchError(f"{p.name} exited with code {p.popen.returncode}:\n{p.tail()}")
                continue
            if not p.alive():
                raise BenchError(f"{p.name} exited early with code {p.popen.returncode}:\n{p.tail()}")

    def sample_cpu(self) -> dict[str, float]:
        return {p.name: round(p.sample_cpu(), 3) for p in self.items if p.alive()}

    def stop_all(self, timeout: float = 10.0) -> None:
        for p in self.items:
            if p.alive():
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        for p in self.items:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.items:
            # the group may hold children (celery, taskiq) even when the leader is gone
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.popen.wait(5)
            except subprocess.TimeoutExpired:
                pass

    def __enter__(self) -> "Procs":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop_all()


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, *, procs: Procs | None = None,
             allow_exited: Sequence[str] = (), interval: float = 0.02) -> Any:
    """Poll ``predicate`` until truthy; fail early when one of ``procs`` died."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if procs is not None:
            procs.check_alive(allow_exited=allow_exited)
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


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


def emit_json(result: Any, json_out: str | None) -> None:
    """Print a bench's JSON document, and write it to ``json_out`` too when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if json_out:
        Path(json_out).write_text(text + "\n")


def stop_processes(procs: Sequence[subprocess.Popen], timeout: float = 30.0) -> None:
    """SIGTERM every process that still runs (they drain), then wait; kill those that do not exit."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
