"""One poller, for what has no event to wait on (another process's state, a file it writes).

Code in this process that can signal should: ``redroll.testing.Pipeline.join``, burst workers and
consumers (``tests.conftest.run_until_drained``) and ``asyncio.Event`` need no poll."""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Callable


class PollTimeout(AssertionError):
    """A polled condition did not hold in time (an ``AssertionError``: a test failure)."""


def _message(what: str, timeout: float) -> str:
    return f"{what} not met within {timeout:g}s"


async def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05, *,
                     what: str = "condition", check: Callable[[], Any] | None = None,
                     error: type[Exception] = PollTimeout) -> Any:
    """Await until ``predicate()`` (sync or async) is truthy and return its value. ``check()`` (sync
    or async) runs after each false answer: it raises to end the wait early (a process died).
    After ``timeout`` seconds raises ``error``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if check is not None:
            checked = check()
            if inspect.isawaitable(checked):
                await checked
        if loop.time() > deadline:
            raise error(_message(what, timeout))
        await asyncio.sleep(interval)


def wait_for(predicate: Callable[[], Any], timeout: float, what: str = "condition", *,
             check: Callable[[], None] | None = None, interval: float = 0.02,
             error: type[Exception] = PollTimeout) -> Any:
    """:func:`wait_until` for code without an event loop (blocking sleeps)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise error(_message(what, timeout))
        time.sleep(interval)
