"""One subprocess helper: start a process with its output in a log file, see whether it lives,
stop it (SIGTERM, then SIGKILL), count its CPU.

:func:`start_process` starts every process the tests and benchmarks run; :class:`Procs` holds
the processes of one benchmark run (each in its own session, stopped by process group);
:func:`stop_process` stops one a test started and fails the test when it ignores SIGTERM."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[2]
CLK_TCK = os.sysconf("SC_CLK_TCK")


class ProcessError(RuntimeError):
    """A process of a run died, or would not stop."""


def start_process(argv: Sequence[str], *, env: dict[str, str] | None = None, log: Path | None = None,
                  cwd: Path = ROOT, new_session: bool = False) -> subprocess.Popen:
    """Start ``argv`` with stdout and stderr appended to ``log`` (default: discarded), stdin closed.
    ``new_session``: in a session (and process group) of its own, so that its children are
    stopped with it (:meth:`Procs.stop_all`)."""
    out: Any = open(log, "ab") if log is not None else subprocess.DEVNULL
    try:
        return subprocess.Popen([str(a) for a in argv], cwd=str(cwd), env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=new_session)
    finally:
        if log is not None:
            out.close()


def redroll_argv(*args: str) -> list[str]:
    """``redroll ARGS`` as this interpreter runs it from the checkout (``python -m redroll.cli``)."""
    return [sys.executable, "-m", "redroll.cli", *args]


def stop_process(proc: subprocess.Popen, timeout: float = 20.0) -> int:
    """SIGTERM a process and wait for it; returns its exit code. One that does not exit in time has
    its stacks printed (py-spy, when installed), is killed, and raises AssertionError (a test
    failure)."""
    if proc.poll() is None:
        proc.terminate()
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        if shutil.which("py-spy"):
            subprocess.run(["py-spy", "dump", "--pid", str(proc.pid)], timeout=30)
        proc.kill()
        proc.wait()
        raise AssertionError(f"process {proc.pid} ({' '.join(map(str, proc.args[-4:]))}) ignored SIGTERM "
                             f"for {timeout}s") from None


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
    """The processes of one run, each in its own session, logging to ``run_dir/<name>.log``;
    stopped (SIGTERM, then SIGKILL to their own group) on exit. ``error`` is what
    :meth:`check_alive` raises."""

    run_dir: Path
    items: list[Proc] = field(default_factory=list)
    error: type[Exception] = ProcessError

    def spawn(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None,
              cwd: Path = ROOT) -> Proc:
        log = self.run_dir / f"{name}.log"
        # nothing of the caller's REDROLL_* settings leaks into a run: each run says what it sets
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("REDROLL_")}
        full_env.update(env or {})
        proc = Proc(name, start_process(argv, env=full_env, log=log, cwd=cwd, new_session=True), log)
        self.items.append(proc)
        return proc

    def check_alive(self, *, allow_exited: Sequence[str] = (), ignore: Sequence[str] = ()) -> None:
        """Raise ``error`` when a process died: one named in ``allow_exited`` may have exited with
        code 0, one named in ``ignore`` (killed on purpose) however it likes."""
        for p in self.items:
            if p.name in ignore:
                continue
            if p.name in allow_exited:
                if p.popen.poll() not in (None, 0):
                    raise self.error(f"{p.name} exited with code {p.popen.returncode}:\n{p.tail()}")
                continue
            if not p.alive():
                raise self.error(f"{p.name} exited early with code {p.popen.returncode}:\n{p.tail()}")

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
