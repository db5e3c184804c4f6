"""Long-running commands (``worker``, ``consume``): metrics, signals and the collector's tuning around a process."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

from redroll.cli.runtime import tune_for_long_runs
from redroll.shared.settings import Settings


def install_signals(stop: Any, grace_s: float) -> Any:
    """First SIGTERM/SIGINT: graceful drain, bounded by ``grace_s`` (then exit: whatever was still
    held is reclaimed by the fleet after claim_idle). Second: exit at once. Returns a function that
    installs the same handlers again (an engine may have replaced them: SGLang does)."""
    loop = asyncio.get_running_loop()
    hits = {"n": 0}

    def give_up() -> None:
        print(f"shutdown took longer than {grace_s:.0f}s: exiting now", file=sys.stderr, flush=True)
        os._exit(1)

    def handler(signum: int) -> None:
        hits["n"] += 1
        if hits["n"] > 1:
            print("second signal: exiting now", file=sys.stderr)
            os._exit(128 + signum)
        loop.call_later(grace_s, give_up)
        stop()

    def install() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, handler, sig)

    install()
    return install


async def serve(process: Any, metrics_class: Any, metrics_port: int | None, settings: Settings,
                metrics_host: str = "127.0.0.1") -> int:
    """Run a long-lived worker or consumer: metrics if asked, signals, GC tuning, until stopped."""
    if metrics_port is not None:
        from redroll.observability.metrics import serve

        process.metrics = metrics_class(process)
        serve(process.metrics, metrics_port, metrics_host)
    install = install_signals(process.request_stop, settings.drain_timeout_s + 10)
    tune_for_long_runs()
    task = asyncio.create_task(process.run())
    started = getattr(process, "started", None)
    if started is not None:
        # SGLang's tokenizer manager puts its own SIGTERM handler on the loop when the engine starts
        # (tokenizer_manager.py:2453-2459): once started, redroll's drain takes SIGTERM back.
        waiter = asyncio.create_task(started.wait())
        await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        install()
    await task
    return getattr(process, "exit_status", 0)
