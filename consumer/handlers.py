"""Named callback handlers. Names come from the operator's command line or code, never from
message content: a record can only select among handlers registered here."""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Awaitable, Callable, Union

from redroll.shared.types import CompletionRecord

Handler = Callable[[CompletionRecord], Union[Any, Awaitable[Any]]]


def load_handler(spec: str) -> Handler:
    """Import ``module:function`` (an operator-given spec, never one read from a record)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"handler {spec!r} must look like module.path:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"handler {spec!r}: cannot import {module_name} ({exc})") from exc
    except Exception as exc:  # (the module itself raised while importing)
        raise ValueError(f"handler {spec!r}: importing {module_name} raised {type(exc).__name__}: {exc}") from exc
    fn: Any = module
    for part in attr.split("."):
        try:
            fn = getattr(fn, part)
        except AttributeError:
            raise ValueError(f"handler {spec!r}: {module_name} has no {attr}") from None
    if not callable(fn):
        raise ValueError(f"handler {spec!r} is not callable")
    return fn  # type: ignore[no-any-return]


def parse_handler_flag(flag: str) -> tuple[str, Handler]:
    """``NAME=module:function`` → (NAME, function)."""
    name, sep, spec = flag.partition("=")
    if not sep or not name:
        raise ValueError(f"--handler {flag!r} must look like NAME=module.path:function")
    return name, load_handler(spec)


class HandlerRegistry:
    """Handlers by name, plus an optional default for records that name none."""

    def __init__(self, handlers: dict[str, Handler] | None = None, default: Handler | None = None):
        self._handlers: dict[str, Handler] = dict(handlers or {})
        self.default = default

    def register(self, name: str, fn: Handler) -> None:
        self._handlers[name] = fn

    def names(self) -> list[str]:
        return sorted(self._handlers)

    def resolve(self, record: CompletionRecord) -> Handler | None:
        if record.callback is None:
            return self.default
        return self._handlers.get(record.callback)

    @staticmethod
    async def call(fn: Handler, record: CompletionRecord) -> None:
        res = fn(record)
        if inspect.isawaitable(res):
            await res
