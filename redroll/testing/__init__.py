"""A whole pipeline in one process, for your own tests: a Redis, synthetic workers, your consumers.

::

    from redroll.testing import Pipeline
    from redroll import make_request

    async def test_rewards_are_stored():
        stored = {}
        async with Pipeline() as pipeline:
            pipeline.consume("trainer", handlers={"score": lambda rec: stored.update({rec.request_id: rec})})
            await pipeline.send([make_request(request_id=f"r{i}", prompt="hi", callback="score")
                                 for i in range(10)])
            await pipeline.join()          # every record out, every group applied it
        assert len(stored) == 10

The Redis is the embedded one (:func:`redroll.testing.embedded.embedded_redis`: ``REDROLL_REDIS_URL`` when
set, else a private ``redis-server``, else in-process fakeredis), each pipeline in a namespace of
its own. The workers run the synthetic engine unless given another. :meth:`Pipeline.join` waits
on events, never on a clock: it returns once every request sent through :meth:`Pipeline.send` has
its record and every consumer group of the pipeline has applied each record it has a handler for,
and fails at once when a worker or consumer crashed.

The pipeline watches the results streams through a consumer group of its own,
:data:`RECORDS_GROUP`, which keeps every record in :attr:`Pipeline.records`.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any, Callable, Iterable

from redis.asyncio import Redis

from redroll.consumer.handlers import Handler, HandlerRegistry
from redroll.consumer.runner import ConsumerRunner
from redroll.engine_worker.engines.base import Engine
from redroll.engine_worker.engines.synthetic import SyntheticEngine
from redroll.engine_worker.worker import Worker
from redroll.producer.client import Producer, send
from redroll.shared.connection import connect
from redroll.shared.errors import RedrollError
from redroll.shared.settings import Settings
from redroll.shared.types import CompletionRecord, GenerationRequest

__all__ = ["JoinTimeout", "Pipeline", "RECORDS_GROUP"]

RECORDS_GROUP = "redroll-testing"
"""The consumer group through which a :class:`Pipeline` sees every record."""


class JoinTimeout(RedrollError, TimeoutError):
    """:meth:`Pipeline.join` gave up: the message says what is still missing."""


class _EveryRecord(HandlerRegistry):
    """Resolves every record to one handler, whatever callback it names."""

    def resolve(self, record: CompletionRecord) -> Handler | None:
        return self.default


class Pipeline:
    """Workers and consumer groups in this event loop, on an embedded Redis (or ``settings``).

    ``workers``: how many workers; ``engine()`` makes each one's engine (default: an instant
    :class:`~redroll.engine_worker.engines.synthetic.SyntheticEngine`); ``settings``: the pipeline
    to run on (default: the embedded Redis, a fresh namespace, ``settings_fields`` applied);
    ``block_ms``: the workers' and consumers' blocking reads.
    """

    def __init__(self, settings: Settings | None = None, *, workers: int = 1,
                 engine: Callable[[], Engine] = SyntheticEngine, max_inflight: int = 16, block_ms: int = 100,
                 **settings_fields: Any) -> None:
        if workers < 0:
            raise ValueError(f"workers must be 0 or more, not {workers}")
        self._given_settings = settings
        self._settings_fields = settings_fields
        self.settings: Settings | None = None
        """The pipeline's settings (known once started)."""
        self.records: dict[str, CompletionRecord] = {}
        """Every record published so far, by request_id (the first one of each)."""
        self.applied: dict[str, set[str]] = {}
        """Consumer group → the request_ids it has applied (acked) so far."""
        self.workers: list[Worker] = []
        self.consumers: list[ConsumerRunner] = []
        self._n_workers = workers
        self._engine = engine
        self._max_inflight = max_inflight
        self._block_ms = block_ms
        self._sent: list[str] = []
        self._changed = asyncio.Event()
        self._tasks: dict[asyncio.Task, str] = {}
        self._stack = contextlib.ExitStack()
        self._redis: Redis | None = None
        self._started = False

    # ------------------------------------------------------------------ lifecycle

    @property
    def redis(self) -> Redis:
        """A client on the pipeline's Redis (for assertions)."""
        if self._redis is None:
            raise RuntimeError("pipeline not started: use 'async with Pipeline() as pipeline'")
        return self._redis

    async def start(self) -> "Pipeline":
        settings = self._given_settings
        if settings is None:
            from redroll.testing.embedded import embedded_redis

            url, _ = self._stack.enter_context(embedded_redis())
            settings = Settings(redis_url=url, namespace="test-" + uuid.uuid4().hex[:10])
        self.settings = settings.with_(**self._settings_fields) if self._settings_fields else settings
        self._redis = connect(self.settings)
        self._started = True
        watcher = ConsumerRunner(self.settings, group=RECORDS_GROUP, block_ms=self._block_ms,
                                 on_applied=self._saw_records)
        watcher.registry = _EveryRecord(None, lambda record: None)
        self._launch(watcher, f"consumer {RECORDS_GROUP}")
        self._watcher = watcher
        for _ in range(self._n_workers):
            self.add_worker()
        for runner in self.consumers:
            self._launch(runner, f"consumer {runner.group}")
        await asyncio.gather(*(w.started.wait() for w in self.workers))
        return self

    async def close(self) -> None:
        """Stop every worker and consumer (each drains), then the embedded Redis."""
        roles = [*self.workers, *self.consumers, *([self._watcher] if self._started else [])]
        for role in roles:
            role.request_stop()
        try:
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self._redis is not None:
                await self._redis.aclose()
        finally:
            self._stack.close()

    async def __aenter__(self) -> "Pipeline":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def _launch(self, role: Worker | ConsumerRunner, what: str) -> None:
        task = asyncio.create_task(role.run(), name=f"redroll.testing {what}")
        self._tasks[task] = what
        task.add_done_callback(lambda _: self._changed.set())

    # ------------------------------------------------------------------ roles

    def add_worker(self, engine: Engine | None = None, **options: Any) -> Worker:
        """Start one more worker (``engine``, default ``engine()`` of the pipeline); ``options`` go
        to :class:`~redroll.engine_worker.worker.Worker`."""
        if not self._started:
            raise RuntimeError("add_worker needs a started pipeline (workers= says how many to start with)")
        options.setdefault("max_inflight", self._max_inflight)
        options.setdefault("block_ms", self._block_ms)
        assert self.settings is not None
        worker = Worker(self.settings, engine or self._engine(), **options)
        self.workers.append(worker)
        self._launch(worker, f"worker {worker.name}")
        return worker

    def consume(self, group: str, handlers: dict[str, Handler] | None = None, *,
                default_handler: Handler | None = None, **options: Any) -> ConsumerRunner:
        """Run a consumer in ``group`` (several calls with one group: several consumers of it).
        ``options`` go to :class:`~redroll.consumer.runner.ConsumerRunner`."""
        if group == RECORDS_GROUP:
            raise ValueError(f"group {RECORDS_GROUP!r} is the pipeline's own; choose another name")
        options.setdefault("block_ms", self._block_ms)
        self.applied.setdefault(group, set())

        def note(records: list[CompletionRecord]) -> None:
            self.applied[group].update(r.request_id for r in records)
            self._changed.set()

        settings = self.settings if self._started else self._given_settings
        if settings is None:
            raise RuntimeError("consume needs a started pipeline, or one given settings")
        runner = ConsumerRunner(settings, group=group, handlers=handlers, default_handler=default_handler,
                                on_applied=note, **options)
        self.consumers.append(runner)
        if self._started:
            self._launch(runner, f"consumer {group}")
        return runner

    def producer(self, **options: Any) -> Producer:
        """A :class:`~redroll.producer.Producer` on this pipeline (start it with ``async with``). Its
        records go to its own reply stream, not to the consumer groups: await its futures rather
        than :meth:`join`."""
        return Producer(self.settings, **options)

    # ------------------------------------------------------------------ traffic

    async def send(self, requests: Iterable[GenerationRequest]) -> list[str]:
        """Queue requests whose records go to the results streams (the consumer groups'); returns
        their entry ids. :meth:`join` waits for these."""
        items = list(requests)
        assert self.settings is not None, "pipeline not started"
        ids = await send(self.settings, self.redis, items)
        self._sent += [req.request_id for req in items]
        return ids

    def _saw_records(self, records: list[CompletionRecord]) -> None:
        for record in records:
            self.records.setdefault(record.request_id, record)
        self._changed.set()

    def missing(self) -> dict[str, list[str]]:
        """What :meth:`join` still waits for: ``{"records": [request_id, ...], "<group>": [...]}``
        (a group lists the records it has a handler for and has not applied); empty when nothing."""
        out: dict[str, list[str]] = {}
        no_record = [rid for rid in self._sent if rid not in self.records]
        if no_record:
            out["records"] = no_record
        for group, applied in self.applied.items():
            runners = [c for c in self.consumers if c.group == group]
            left = [rid for rid in self._sent if rid in self.records and rid not in applied
                    and any(c.registry.resolve(self.records[rid]) is not None for c in runners)]
            if left:
                out[group] = left
        return out

    def _raise_if_crashed(self) -> None:
        for task, what in self._tasks.items():
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise RuntimeError(f"redroll.testing: {what} crashed: {task.exception()!r}") from task.exception()

    async def join(self, timeout: float = 30.0) -> None:
        """Wait until every request sent through :meth:`send` has its record and every consumer
        group applied each one it has a handler for. Raises :class:`JoinTimeout` (naming what is
        missing) after ``timeout`` seconds, and at once when a worker or consumer crashed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            self._changed.clear()
            self._raise_if_crashed()
            left = self.missing()
            if not left:
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                dead = await self._dead_letters()
                parts = [f"{len(ids)} {'without a record' if k == 'records' else f'not applied by group {k!r}'} "
                         f"(e.g. {', '.join(ids[:3])})" for k, ids in left.items()]
                raise JoinTimeout(f"join: after {timeout:g}s, " + "; ".join(parts)
                                  + (f"; {dead} dead letter(s)" if dead else ""))
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    async def _dead_letters(self) -> int:
        assert self.settings is not None
        return sum([int(await self.redis.xlen(part.dead)) for part in self.settings.partition_keys])
