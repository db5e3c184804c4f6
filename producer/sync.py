"""A thin synchronous facade over :class:`redroll.producer.client.Producer` for non-async callers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from concurrent.futures import Future
from operator import attrgetter
from typing import Any, Callable, Iterable, Iterator

from redroll.producer.client import Callback, Producer, warn_renamed
from redroll.producer.rollout import GroupOutcome, RolloutGroup
from redroll.producer.session import Session
from redroll.producer.stream_reader import StreamChunk
from redroll.shared.settings import Settings
from redroll.shared.types import CompletionRecord, GenerationRequest


class SyncProducer:
    """Runs an async producer on a private event loop thread.

    ``with SyncProducer(settings) as p: record = p.generate(prompt="hi")``

    The keyword options are :class:`Producer`'s, with the same meaning. Callbacks and
    ``before_ack`` run on the producer's own thread, not the caller's.

    What it has, each blocking the caller until done and with :class:`Producer`'s arguments:
    ``submit``/``submit_many`` (concurrent futures), ``generate``, ``stream`` (a plain iterator of
    chunks), ``generate_across_updates``,
    ``result``, ``abort``, ``as_completed`` (a plain iterator), ``submit_group`` (a
    :class:`SyncRolloutGroup`: ``wait``, ``take``, ``stream``, ``abort``), ``session`` (a
    :class:`SyncSession`: ``turn``), ``update_weights``, ``set_weight_version`` and
    ``weight_sync`` (a ``with`` block whose ``push(...)`` runs on the producer's loop).

    What it lacks: ``unclaimed()`` (an endless async iterator; ask ``result(request_id)`` for a
    known id instead) and the ``redis`` client, which belongs to the producer's loop.

    ``close()`` (or leaving the ``with`` block) closes the producer, cancels and awaits every
    task still on its loop (a read asked for ahead, work a callback started), then stops and
    closes the loop: outstanding futures are cancelled, and nothing is left pending.
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

    name = property(attrgetter("_producer.name"))
    outstanding = property(attrgetter("_producer.outstanding"),
                           doc="Requests submitted here whose record has not arrived yet.")

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

    def generate_across_updates(self, request: GenerationRequest | None = None, **fields: Any) -> CompletionRecord:
        return self._call(self._producer.generate_across_updates(request, **fields))

    def generate_resumable(self, request: GenerationRequest | None = None, **fields: Any) -> CompletionRecord:
        """Deprecated: the old name of :meth:`generate_across_updates` (warns once per process)."""
        warn_renamed("generate_resumable", "generate_across_updates")
        return self.generate_across_updates(request, **fields)

    def stream(self, request: GenerationRequest | None = None, *, timeout: float | None = None,
               **fields: Any) -> Iterator[StreamChunk]:
        """:meth:`Producer.stream` as a plain iterator (each chunk as it comes). Leaving the loop
        early stops reading; the request goes on (``abort`` it if it should not)."""
        chunks = self._producer.stream(request, timeout=timeout, **fields)
        try:
            while True:
                try:
                    yield self._call(chunks.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._call(chunks.aclose())

    def result(self, request_id: str, timeout: float | None = None) -> CompletionRecord:
        return self._call(self._producer.result(request_id, timeout))

    def abort(self, request_ids: Iterable[str] = (), *, group_id: str | None = None) -> list[str]:
        return self._call(self._producer.abort(list(request_ids), group_id=group_id))

    def as_completed(self, futures: Iterable[Future], timeout: float | None = None) -> Iterator[CompletionRecord]:
        """Yield the records of ``futures`` (from :meth:`submit`) in the order they complete."""
        for fut in concurrent.futures.as_completed(list(futures), timeout):
            yield fut.result()

    def submit_group(self, n: int, *, group_id: str | None = None, callback: Callback | None = None,
                     **fields: Any) -> "SyncRolloutGroup":
        """One prompt's ``n`` samples (see :meth:`Producer.submit_group`)."""
        group = self._call(self._producer.submit_group(n, group_id=group_id, callback=callback, **fields))
        return SyncRolloutGroup(self, group)

    def session(self, key: str | None = None) -> "SyncSession":
        """A multi-turn conversation (see :meth:`Producer.session`)."""
        return SyncSession(self, self._producer.session(key))

    def update_weights(self, model_path: str, weight_version: str, **options: Any) -> dict[str, dict[str, Any]]:
        """See :meth:`Producer.update_weights` (same options)."""
        return self._call(self._producer.update_weights(model_path, weight_version, **options))

    def set_weight_version(self, version: int) -> None:
        async def go() -> None:
            self._producer.set_weight_version(version)

        self._call(go())

    def weight_sync(self, **options: Any) -> "SyncWeightSync":
        """``with p.weight_sync(backend="gloo") as sync: sync.push(model.named_parameters(), version="12")``
        (see :class:`redroll.producer.weight_sync.WeightSync` for the options)."""
        return SyncWeightSync(self, self._producer.weight_sync(**options))

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

    async def _shutdown(self) -> None:
        try:
            await self._producer.close()
        finally:
            current = asyncio.current_task()
            # (twice: a task cancelled here may start another while it unwinds)
            for _ in range(2):
                left = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
                for task in left:
                    task.cancel()
                await asyncio.gather(*left, return_exceptions=True)
            await self._loop.shutdown_asyncgens()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        if self._loop.is_running():
            try:
                self._call(self._shutdown())
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> "SyncProducer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class SyncRolloutGroup:
    """:class:`RolloutGroup` for :class:`SyncProducer`: the same methods, blocking."""

    def __init__(self, producer: SyncProducer, group: RolloutGroup):
        self._sp = producer
        self._group = group
        self.group_id = group.group_id
        self.futures = {rid: producer._wrap(f) for rid, f in group.futures.items()}

    @property
    def request_ids(self) -> list[str]:
        return list(self.futures)

    def stream(self, timeout: float | None = None) -> Iterator[CompletionRecord]:
        """Members' records as they finish."""
        return self._sp.as_completed(self.futures.values(), timeout)

    def wait(self, timeout: float | None = None) -> list[CompletionRecord]:
        return self._sp._call(self._group.wait(timeout))

    def take(self, k: int, accept: Callable[[CompletionRecord], bool] = lambda r: True,
             timeout: float | None = None) -> GroupOutcome:
        """``accept`` runs on the producer's thread."""
        return self._sp._call(self._group.take(k, accept, timeout))

    def abort(self) -> None:
        self._sp._call(self._group.abort())


class SyncSession:
    """:class:`Session` for :class:`SyncProducer`: ``turn(new_ids, **fields)`` blocks for the reply."""

    def __init__(self, producer: SyncProducer, session: Session):
        self._sp = producer
        self._session = session

    key = property(attrgetter("_session.key"))
    conversation = property(attrgetter("_session.conversation"))
    records = property(attrgetter("_session.records"))

    def turn(self, new_ids: list[int], **fields: Any) -> CompletionRecord:
        return self._sp._call(self._session.turn(new_ids, **fields))


class SyncWeightSync:
    """``producer.weight_sync(...)`` for :class:`SyncProducer`: a ``with`` block; ``push`` runs on
    the producer's loop and returns its :class:`~redroll.producer.weight_sync.PushReport`."""

    def __init__(self, producer: SyncProducer, sync: Any):
        self._sp = producer
        self._sync = sync

    def __enter__(self) -> "SyncWeightSync":
        self._sp._call(self._sync.__aenter__())
        return self

    def __exit__(self, *exc: Any) -> None:
        self._sp._call(self._sync.__aexit__(*exc))

    def push(self, named_tensors: Iterable[tuple[str, Any]], version: str, *,
             checkpoint_path: str | None = None) -> Any:
        return self._sp._call(self._sync.push(list(named_tensors), version, checkpoint_path=checkpoint_path))
