"""Running redroll's asyncio entry points: on uvloop when it is installed (a dependency except
on Windows).

uvloop's libuv-based loop cuts the per-request event-loop cost of workers, consumers and
producers; set ``REDROLL_UVLOOP=0`` to use the standard loop.

What exists when an entry point starts (modules, classes, settings: alive for the whole process)
is moved out of the garbage collector's sight first (:func:`gc.freeze`), so that its full
collections, which come more often the more objects a busy process makes, walk only what the
process made since.
"""

from __future__ import annotations

import asyncio
import gc
import os
from typing import Any, Awaitable, Callable, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    if os.environ.get("REDROLL_UVLOOP", "1") == "0":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Awaitable[T]) -> T:
    """``asyncio.run`` on the fastest available loop, with what exists so far frozen (:func:`gc.freeze`)."""
    gc.freeze()
    factory = loop_factory()
    if factory is None:
        return asyncio.run(main)  # type: ignore[arg-type]
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)  # type: ignore[arg-type]


def loop_name() -> str:
    return "uvloop" if loop_factory() is not None else "asyncio"


__all__: list[Any] = ["loop_factory", "loop_name", "run"]
