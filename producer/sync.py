"""A thin synchronous facade over :class:`redroll.producer.client.Producer` for non-async callers."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any, Callable, Iterable

from redroll.shared.settings import Settings
from redroll.shared.types import CompletionRecord, GenerationRequest

from .client import Callback, Producer


class SyncProducer:
    """Runs an async producer on a private event loop thread.

    ``with SyncProducer(settings) as p: record = p.generate(prompt="hi")``

    The keyword options are :class:`Producer`'s, with the same meaning. Callbacks and
    ``before_ack`` run on the producer's own thread, not the caller's.
    """

    def __init__(self, settings: Settings | None = None, *, name: str | None = None, block_ms: int = 1000,
                 read_count: int = 256, max_inflight: int | None = None, max_staleness: int | None = None,
                 batch_size: int | None = None, tokens_from_ids: bool = False,
                 before_ack: Callable[[], None] | None = None):
        self._producer = Producer(settings, name=name, block_ms=block_ms, read_count=read_count,
                                  max_inflight=max_inflight, max_staleness=max_staleness, batch_size=batch_size,
                                  tokens_from_ids=tokens_from_ids, before_ack=before_ack)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="redroll-producer", daemon=True)
        self._thread.start()
        try:
            self._call(self._producer.start())
        except BaseException:  # (a refused connection, a lanes mismatch): no thread or loop is left behind
            self.close()
            raise

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @property
    def name(self) -> str:
        return self._producer.name

    @property
    def outstanding(self) -> int:
        """Requests submitted here whose record has not arrived yet."""
        return self._producer.outstanding

    def submit(self, request: GenerationRequest | None = None, *, callback: Callback | None = None,
               **fields: Any) -> Future:
        """Queue one request; returns a concurrent future of its record."""
        async def go() -> asyncio.Future:
            return await self._producer.submit(request, callback=callback, **fields)

        return self._wrap(self._call(go()))

    def submit_many(self, requests: Iterable[GenerationRequest | dict], *, callback: Callback | None = None) -> list[Future]:
        futs = self._call(self._producer.submit_many(list(requests), callback=callback))
        return [self._wrap(f) for f in futs]

    def generate(self, request: GenerationRequest | None = None, *, timeout: float | None = None,
                 **fields: Any) -> CompletionRecord:
        """Submit and wait for the record."""
        return self.submit(request, **fields).result(timeout)

    def result(self, request_id: str, timeout: float | None = None) -> CompletionRecord:
        return self._call(self._producer.result(request_id, timeout))

    def abort(self, request_ids: Iterable[str] = (), *, group_id: str | None = None) -> list[str]:
        return self._call(self._producer.abort(list(request_ids), group_id=group_id))

    def _wrap(self, afut: asyncio.Future) -> Future:
        cf: Future = Future()

        def copy(f: asyncio.Future) -> None:
            if f.cancelled():
                cf.cancel()
            elif f.exception() is not None:
                cf.set_exception(f.exception())
            else:
                cf.set_result(f.result())

        self._loop.call_soon_threadsafe(afut.add_done_callback, copy)
        return cf

    def close(self) -> None:
        if self._loop.is_closed():
            return
        if self._loop.is_running():
            try:
                self._call(self._producer.close())
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> "SyncProducer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
