"""Writes Redis refused, and whether waiting fixes them.

A script reports what a stream answered instead of failing midway (see the Lua scripts): out of
memory, a read-only replica, a stream whose ids are exhausted, a key of another type. Some of these
pass by themselves (memory is freed, a failover completes); the others stay until someone repairs
the key (``redroll repair``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, TypeVar

import redis

from redroll.shared.errors import RedrollError

T = TypeVar("T")
log = logging.getLogger("redroll")

TRANSIENT = ("OOM", "READONLY", "LOADING", "BUSY", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "MISCONF",
             "NOREPLICAS", "UNBLOCKED")
"""Error codes of refusals that pass without repair (Redis error replies start with their code)."""


def error_code(message: str) -> str:
    """The code of a Redis error reply ("OOM command not allowed …" → "OOM")."""
    head = message.split(" ", 1)[0]
    return head if head.isupper() else "ERR"


def is_transient(message: str) -> bool:
    return error_code(message) in TRANSIENT


def describe(message: str) -> str:
    """A short name for the kind of refusal (metrics, status)."""
    code = error_code(message)
    if code == "OOM":
        return "out_of_memory"
    if code == "READONLY":
        return "read_only"
    if code == "WRONGTYPE":
        return "wrong_type"
    if "exhausted the last possible ID" in message:
        return "ids_exhausted"
    return "transient" if code in TRANSIENT else "other"


class StreamRefusedError(RedrollError, redis.ResponseError):
    """``key`` refused a write with ``message``; nothing of that item was written."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key} refused the write: {message}")
        self.key = key
        self.message = message

    @property
    def transient(self) -> bool:
        return is_transient(self.message)

    @property
    def kind(self) -> str:
        return describe(self.message)


def passes(exc: BaseException) -> bool:
    """A refusal that passes by itself: out of memory, a read-only replica, ... (and a MULTI that
    Redis discarded because a command in it was refused so: EXECABORT)."""
    if isinstance(exc, StreamRefusedError):
        return exc.transient
    if isinstance(exc, (redis.exceptions.ExecAbortError, redis.exceptions.ReadOnlyError,
                        redis.exceptions.OutOfMemoryError)):
        return True
    return isinstance(exc, redis.ResponseError) and is_transient(str(exc))


async def retry_refused(call: Callable[[], Awaitable[T]], what: str, timeout_s: float = 120.0) -> T:
    """``call()``, again with backoff while Redis refuses it for a passing reason (see
    :func:`passes`), for up to ``timeout_s``; then, or for any other error, it raises."""
    deadline = time.monotonic() + timeout_s
    delay, said = 0.1, False
    while True:
        try:
            result = await call()
        except redis.ResponseError as exc:
            if not passes(exc) or time.monotonic() > deadline:
                raise
            if not said:
                log.error("%s: Redis refuses it (%s); retrying for up to %.0fs", what, exc, timeout_s)
                said = True
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
            continue
        if said:
            log.info("%s: accepted again", what)
        return result


def is_refusal(exc: BaseException) -> bool:
    """A Redis error reply that refused a write (not a connection problem, not a script bug)."""
    if isinstance(exc, StreamRefusedError):
        return True
    if isinstance(exc, (redis.exceptions.ExecAbortError, redis.exceptions.ReadOnlyError,
                        redis.exceptions.OutOfMemoryError)):
        return True
    return isinstance(exc, redis.ResponseError) and (
        is_transient(str(exc)) or describe(str(exc)) in ("wrong_type", "ids_exhausted"))
