"""The child guard: an engine's processes die with the worker, however it dies; nothing else does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.conftest import ROOT

PARENT = r"""
import json, subprocess, sys, time
from redroll.engine_worker.engines.child_guard import ChildGuard
before = subprocess.Popen(["sleep", "300"])           # not the engine's: started before the guard
guard = ChildGuard.start(poll_s=0.05)
snapshot = guard.children_now()
engine = subprocess.Popen(["sleep", "300"])           # the "engine", started while it starts
time.sleep(0.3)
if sys.argv[1] == "keep":
    guard.keep(guard.children_now() - snapshot)
    time.sleep(0.2)
later = subprocess.Popen(["sleep", "300"])            # started after the engine was named
time.sleep(0.3)
print(json.dumps({"before": before.pid, "engine": engine.pid, "later": later.pid, "guard": guard.process.pid}),
      flush=True)
if sys.argv[2] == "close":
    guard.close()
    print("closed", flush=True)
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _run(*args: str) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-c", PARENT, *args], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    pids = json.loads(proc.stdout.readline())
    return proc, pids


def _wait_dead(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.02)
    return False


def _cleanup(pids: dict) -> None:
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def test_a_sigkilled_parent_takes_the_engine_processes_along_and_nothing_older():
    proc, pids = _run("keep", "stay")
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert _wait_dead(pids["engine"]) and _wait_dead(pids["guard"])
        assert _alive(pids["before"]) and _alive(pids["later"])  # only the named engine's processes
    finally:
        _cleanup(pids)


def test_a_death_while_the_engine_starts_takes_every_new_child():
    proc, pids = _run("starting", "stay")  # never named: the engine was still starting
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert _wait_dead(pids["engine"]) and _wait_dead(pids["later"])
        assert _alive(pids["before"])
    finally:
        _cleanup(pids)


def test_close_kills_what_the_engine_left_behind():
    proc, pids = _run("keep", "close")
    try:
        assert proc.stdout.readline().strip() == "closed"
        assert _wait_dead(pids["engine"]) and not _alive(pids["guard"])
        assert _alive(pids["before"]) and _alive(pids["later"]) and proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
        _cleanup(pids)
