"""What every part of a running worker shares: its settings, names, Redis client and counters."""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from redroll.engine_worker.deliveries import DeliveryLog
from redroll.engine_worker.engines.base import Engine, EngineCapabilities
from redroll.engine_worker.engines.declaration import capabilities_of
from redroll.engine_worker.publisher import Publisher
from redroll.observability.tracing import tracer
from redroll.shared.batcher import CommandBatcher
from redroll.shared.connection.durability import Durability
from redroll.shared.events import EventLog
from redroll.shared.keys import Keys
from redroll.shared.scripts import Scripts
from redroll.shared.settings import Settings


@dataclass
class WorkerStats:
    """What this worker did since it started (its heartbeat, metrics and logs read them).

    Attributes:
        claimed: entries claimed new (not taken back).
        reclaimed: entries taken back from a dead worker or a hand-back.
        checkpoints: checkpoint parts saved (streamed chunks included).
        resumed: requests continued from a checkpoint.
        published: records published by the finish.
        fenced: finishes and dead letters refused because another worker held the entry.
        lease_losses: entries whose lease this worker lost while it ran them.
        dead_lettered: entries this worker dead-lettered.
        handed_back: entries handed back (a drain, a notice, a newer schema).
        engine_errors: generations the engine failed.
        tokens: output tokens of the records it published.
        by_status: records published by status.
    """

    claimed: int = 0
    reclaimed: int = 0
    checkpoints: int = 0
    resumed: int = 0
    published: int = 0
    fenced: int = 0
    lease_losses: int = 0
    dead_lettered: int = 0
    handed_back: int = 0
    engine_errors: int = 0
    tokens: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)
    """Writes Redis refused, by kind (out_of_memory, ids_exhausted, wrong_type, read_only, ...)."""
    queued: int | None = None
    """With affinity lanes and metrics on: entries queued (not yet claimed) in every request stream
    of this worker's partitions, summed (KEDA scales on it; its own triggers take a maximum)."""
    claims_by_kind: dict[str, int] = field(default_factory=dict)
    """With affinity lanes: entries claimed from the high-priority stream, an own lane, the shared
    stream, stolen from another lane, or woken by a blocking read."""


@dataclass(eq=False)
class WorkerContext:
    """The wiring of one running worker (built when it starts)."""

    settings: Settings
    name: str
    engine: Engine
    redis: Redis
    parts: list[Keys]
    """Per-request keys of the partitions this worker serves."""
    stats: WorkerStats
    stopping: asyncio.Event
    block_ms: int
    metrics: Any = None
    """A :class:`redroll.observability.metrics.WorkerMetrics` when metrics are served."""
    started_at: float = field(default_factory=time.monotonic)
    """When this run of the worker began (``time.monotonic``): entries delivered to its name before
    were a previous run's (a restart with the same ``--name``)."""
    engine_failure: str | None = None
    """Why the engine can serve nothing any more (it raised :class:`~.engines.base.EngineDeadError`):
    the worker then stops at once, hands everything back and exits with status 1."""

    def __post_init__(self) -> None:
        self.capabilities: EngineCapabilities = capabilities_of(self.engine)
        """What the engine declares it can do beyond the Engine protocol: every part of the worker
        asks this, never the engine's methods."""
        self.keys: Keys = self.settings.keys
        """Pipeline-wide keys (control, weights, workers, aborted, errors)."""
        self.scripts = Scripts(self.redis, EventLog.from_settings(self.settings))
        self.batcher = CommandBatcher(self.redis)
        self.publisher = Publisher(self.scripts, self.name,
                                   durability=Durability.of(self.settings))
        self.deliveries = DeliveryLog(self.redis, self.scripts.events, self.name)
        """Each delivery (a claim read, a reclaim) noted in its request's event log."""
        self.tracer = tracer()
        """OpenTelemetry's tracer when a tracer provider is set (redroll/observability/tracing.py), else None."""
        # Claiming order: every partition's high-priority stream, its lanes, then every normal one.
        self.request_streams = ([k.requests_high for k in self.parts] + [s for k in self.parts for s in k.lane_streams]
                                + [k.requests for k in self.parts])
        self.part_of = {stream: k for k in self.parts for stream in k.request_streams}
        """Request stream → the keys of its partition."""

    @functools.cached_property
    def normal_stream(self) -> str:
        return self.keys.requests

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer when it declares one (``tokenizer``), else None (read each time:
        an engine has it only once started)."""
        return self.engine.tokenizer if self.capabilities.tokenizer else None  # type: ignore[attr-defined]

    def flight_key(self, stream: str, entry_id: str) -> str:
        """Unique over every request stream (the plain normal stream keeps bare entry ids)."""
        return entry_id if stream == self.normal_stream else f"{stream}/{entry_id}"

    def engine_died(self, reason: str) -> None:
        """The engine raised :class:`~.engines.base.EngineDeadError`: stop the worker now (no drain:
        nothing more finishes here), once, keeping the first reason."""
        if self.engine_failure is None:
            self.engine_failure = reason
        self.stopping.set()

    async def pause(self, seconds: float) -> None:
        """Sleep, but wake at once when a stop is requested."""
        try:
            await asyncio.wait_for(self.stopping.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    async def close(self) -> None:
        await self.batcher.close()
        await self.publisher.close()
        await self.deliveries.close()
