"""Stopping the SGLang adapter's processes (a mixin of :class:`.sglang_engine.SGLangEngine`).

References are to files under ``sglang/srt/`` of sglang 0.5.23, as in :mod:`.sglang_engine`.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import signal
from typing import Any

log = logging.getLogger(__name__)


class SGLangProcess:
    """Mixin: needs ``self.shutdown_timeout_s``."""

    shutdown_timeout_s: float

    async def _shutdown(self, engine: Any) -> None:
        """Stop SGLang without ``Engine.shutdown()``: that blocks the loop for up to 60 s, SIGKILLs
        every child of this process (not only SGLang's) and raises on timeout (entrypoints/engine.py
        :1450-1497, utils/common.py:2507-2564); it is also registered with atexit (:326). Here: stop
        its watchdog and tasks, and kill only the processes SGLang started (:398-400), reaped off
        the loop."""
        with contextlib.suppress(Exception):
            atexit.unregister(engine.shutdown)
        tm = getattr(engine, "tokenizer_manager", None)
        watchdog = getattr(tm, "_subprocess_watchdog", None)
        if watchdog is not None:
            with contextlib.suppress(Exception):
                watchdog.stop()
        for task in list(getattr(tm, "asyncio_tasks", ()) or ()):
            task.cancel()
        pids: list[int] = []
        with contextlib.suppress(Exception):
            pids = [int(p) for p in engine.get_all_child_pids()]
        for pid in pids:
            with contextlib.suppress(Exception):
                os.kill(pid, signal.SIGKILL)
        if pids:
            left = await asyncio.to_thread(_reap, pids, self.shutdown_timeout_s)
            if left:
                log.error("SGLang processes %s did not exit within %.0fs after SIGKILL", left, self.shutdown_timeout_s)


def _reap(pids: list[int], timeout_s: float) -> list[int]:
    """Wait (in a thread) until ``pids`` are gone; returns those still there after ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    left = list(pids)
    while left and time.monotonic() < deadline:
        still = []
        for pid in left:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not our child (or reaped): is it still there?
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    continue
                still.append(pid)
                continue
            if done == 0:
                still.append(pid)
        left = still
        if left:
            time.sleep(0.05)
    return left
