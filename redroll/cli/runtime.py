"""Running redroll's asyncio entry points: on uvloop when it is installed (a dependency except
on Windows), and the one place where the garbage collector is tuned.

uvloop's libuv-based loop cuts the per-request event-loop cost of workers, consumers and
producers; set ``REDROLL_UVLOOP=0`` to use the standard loop.

The collector: what exists when an entry point starts (modules, classes, settings: alive for the
whole process) is moved out of its sight first (:func:`gc.freeze`), so that its full collections,
which come more often the more objects a busy process makes, walk only what the process made
since; a long-running worker or consumer also collects young objects less often
(:func:`tune_for_long_runs`); a bulk load that makes no reference cycles runs with the collector
off and is frozen after (:func:`collector_paused`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
from typing import Any, Awaitable, Callable, Iterator, TypeVar

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


def tune_for_long_runs() -> None:
    """A worker's or consumer's process: freeze what exists, and collect young objects less often
    (the hot paths allocate many short-lived, acyclic objects)."""
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No collection while the block makes many objects that hold no reference cycles and live
    until the process ends (``redroll submit`` reading its file); they are frozen after it."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def loop_name() -> str:
    return "uvloop" if loop_factory() is not None else "asyncio"


__all__: list[Any] = ["collector_paused", "loop_factory", "loop_name", "run", "tune_for_long_runs"]
