"""Leave no engine process behind: a guard that kills a worker's descendants when the worker dies.

Engines such as vLLM start their own processes (vLLM: an engine core, which starts a model
worker) and none of them watches its parent: a SIGKILLed redroll worker would leave them running,
holding memory and accelerators. :class:`ChildGuard` starts a small separate process before the
engine starts. While the worker lives, the guard notes the engine's processes (pid and start
time, from ``/proc``) every ``poll_s``: the worker's descendants that appear after the guard
started, and once the engine is up, only the children the worker names (those that appeared while
the engine started) and their descendants; when its standard input closes — the worker exited, in
any way, SIGKILL included, since the kernel closes the pipe — it SIGKILLs every noted process that
is still the same process (same start time: a recycled pid is left alone). A clean shutdown
closes the pipe too (:meth:`ChildGuard.close`), so whatever the engine's own shutdown missed goes
the same way.

Linux only (``/proc``); elsewhere :meth:`ChildGuard.start` returns None and logs why.

    python -m redroll.engine_worker.engines.child_guard PARENT_PID [POLL_S [OLDER_PID ...]]
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

log = logging.getLogger(__name__)


def _start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/PID/stat`` (start time in clock ticks), None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ")"
    fields = stat[stat.rfind(b")") + 2:].split()
    return int(fields[19])


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process visible in ``/proc``."""
    out: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        out[int(name)] = int(stat[stat.rfind(b")") + 2:].split()[1])
    return out


def descendants(root: int) -> list[int]:
    """Every live descendant of ``root`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _parents().items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def _children(parent: int) -> set[int]:
    return {pid for pid, ppid in _parents().items() if ppid == parent}


def guard(parent: int, poll_s: float = 0.5, baseline: set[int] | None = None) -> int:
    """The guard process's body: note the engine's processes until stdin closes, then kill them.

    Processes that were ``parent``'s descendants before the guard started (``baseline``, as the
    parent saw them) are never noted. Until
    the worker names the engine's processes (a line ``keep PID ...``), every new descendant is
    noted (the engine is starting: a death then still takes its processes along); after it, only
    the named processes and their descendants."""
    me = os.getpid()
    baseline = set(descendants(parent)) if baseline is None else baseline
    roots: set[int] | None = None
    seen: dict[int, int] = {}
    closed = threading.Event()
    lock = threading.Lock()

    def read_stdin() -> None:
        nonlocal roots
        try:
            for line in sys.stdin.buffer:
                words = line.split()
                if words[:1] == [b"keep"]:
                    with lock:
                        roots = {int(w) for w in words[1:]}
        finally:
            closed.set()

    def watched() -> list[int]:
        with lock:
            if roots is None:
                return [p for p in descendants(parent) if p not in baseline]
            out = [r for r in roots if _start_time(r) is not None]
            for r in list(out):
                out.extend(descendants(r))
            for pid in list(seen):  # named ones only from now on
                if pid not in out:
                    del seen[pid]
            return out

    threading.Thread(target=read_stdin, daemon=True).start()
    while True:
        for pid in watched():
            if pid != me and pid not in seen:
                started = _start_time(pid)
                if started is not None:
                    seen[pid] = started
        if closed.wait(poll_s):
            break
    for pid in watched():  # (the last ones started since the last poll)
        if pid != me and pid not in seen and roots is not None:
            started = _start_time(pid)
            if started is not None:
                seen[pid] = started
    for pid, started in seen.items():
        if _start_time(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    return 0


class ChildGuard:
    """The worker's side: start the guard before the engine, :meth:`close` after it stopped."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process

    @classmethod
    def start(cls, poll_s: float = 0.5) -> "ChildGuard | None":
        if not os.path.isdir("/proc/self"):
            log.warning("no /proc: engine processes are not guarded against this worker's death")
            return None
        process = subprocess.Popen(
            [sys.executable, "-m", "redroll.engine_worker.engines.child_guard", str(os.getpid()), str(poll_s),
             *map(str, descendants(os.getpid()))],
            stdin=subprocess.PIPE, start_new_session=True)  # (its own session: a Ctrl-C does not stop it first)
        return cls(process)

    def children_now(self) -> set[int]:
        """This process's children, but the guard (snapshot before the engine starts)."""
        return _children(os.getpid()) - {self.process.pid}

    def keep(self, pids: set[int]) -> None:
        """Name the engine's processes (children that appeared while it started): only they and
        their descendants are killed from now on."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.write(("keep " + " ".join(map(str, sorted(pids))) + "\n").encode())
            self.process.stdin.flush()

    def close(self, timeout_s: float = 10.0) -> None:
        """Let the guard kill what is left of the engine's processes, and wait for it."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        deadline = time.monotonic() + timeout_s
        while self.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


if __name__ == "__main__":  # pragma: no cover - runs as the guard process
    raise SystemExit(guard(int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.5,
                           {int(x) for x in sys.argv[3:]}))
