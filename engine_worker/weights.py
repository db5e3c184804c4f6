"""Weight updates and engine memory: pause claiming, quiesce, act on the engine, resume.

A request may need newer weights than this worker serves (``min_weight_version``): it waits
here, parked and leased, until the update it needs lands.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

import redis

from redroll.shared.commands import Command, CommandFailed, ReleaseMemory, ResumeMemory, UpdateWeights
from redroll.shared.control import send_command
from redroll.shared.streams import text
from redroll.shared.types import RecordStatus

from .context import WorkerContext
from .flights import Flights

log = logging.getLogger("redroll.worker")


def version_number(version: Any) -> int | None:
    """Weight versions are compared as integers ("200" → 200); anything else has no order."""
    try:
        return int(str(version))
    except (TypeError, ValueError):
        return None


class WeightsGate:
    def __init__(self, ctx: WorkerContext, flights: Flights, *, heartbeat: Callable[[], Awaitable[None]]):
        self.ctx = ctx
        self.flights = flights
        self._heartbeat = heartbeat
        self._lock = asyncio.Lock()

    @property
    def engine(self) -> Any:
        return self.ctx.engine

    def serves(self, minimum: int) -> bool:
        have = version_number(self.engine.info.weight_version)
        return have is not None and have >= minimum

    async def desired_version(self) -> int | None:
        """The pipeline's desired weight version (``{ns}:weights``), as a number."""
        raw = await self.ctx.redis.hget(self.ctx.keys.weights, "weight_version")
        return version_number(text(raw or b""))

    async def run_command(self, cmd: Command) -> None:
        """Run a weights or memory command; a failure (or a refusal: an engine refuses what would
        crash it) is logged and reported on the control stream as ``command_failed``, naming this
        worker, the command and the error (``redroll weights`` prints it)."""
        try:
            if isinstance(cmd, UpdateWeights):
                await self.update(cmd.model_path, cmd.weight_version, abort_inflight=cmd.abort_inflight)
            elif isinstance(cmd, ReleaseMemory):
                await self.release_memory()
            elif isinstance(cmd, ResumeMemory):
                await self.resume_memory()
        except Exception as exc:
            log.error("control command %s failed: %s: %s", cmd.kind, type(exc).__name__, exc)
            try:
                await send_command(self.ctx.redis, self.ctx.keys, CommandFailed(
                    worker=self.ctx.name, command=cmd.kind, error=f"{type(exc).__name__}: {exc}"[:500]))
            except redis.RedisError as report_exc:
                log.warning("could not report the failure of %s: %s", cmd.kind, report_exc)

    async def _quiesce(self, hold: str, abort_inflight: bool = False) -> None:
        """Stop claiming and wait until nothing is in flight (aborting it first when asked)."""
        self.flights.hold(hold)
        if abort_inflight:
            for flight in self.flights:
                if flight.task is not None:  # deferred ones simply run later, on the new weights
                    flight.stop(self.engine, RecordStatus.ABORTED, "weight_update")
        await self.flights.wait_idle()

    async def update(self, model_path: str, weight_version: str | None, *, abort_inflight: bool = False) -> None:
        """Stop claiming, let in-flight requests finish (or abort them: with collect_unfinished their
        partial output is published), load the new weights, resume. Records generated after this
        carry the new weight_version; none generated before do."""
        async with self._lock:
            if weight_version is not None and weight_version == self.engine.info.weight_version:
                return
            log.info("weight update to %s (version %s): pausing claims", model_path, weight_version)
            await self._quiesce("weights", abort_inflight)
            try:
                update = getattr(self.engine, "update_weights_from_disk", None)
                if update is None:
                    raise RuntimeError(f"the {self.engine.info.name} engine cannot update weights")
                await update(model_path, weight_version)
                log.info("weights now at version %s", self.engine.info.weight_version)
                await self._heartbeat()
                self.flights.resume_parked()
            finally:
                self.flights.release("weights")

    async def release_memory(self) -> None:
        """Free engine memory for a colocated trainer; claiming stays paused until resume (and
        resumes at once when the engine refuses the release)."""
        await self._quiesce("memory")
        release = getattr(self.engine, "release_memory_occupation", None)  # (none: nothing to free)
        try:
            if release is not None:
                await release()
        except BaseException:
            self.flights.release("memory")
            raise
        finally:
            await self._heartbeat()

    async def resume_memory(self) -> None:
        resume = getattr(self.engine, "resume_memory_occupation", None)
        if resume is not None:
            await resume()
        self.flights.release("memory")
        await self._heartbeat()

    async def load_desired(self) -> None:
        """A worker that joins late loads the desired weights before claiming anything."""
        desired = await self.ctx.redis.hgetall(self.ctx.keys.weights)
        if not desired:
            return
        version = text(desired.get(b"weight_version", b"")) or None
        path = text(desired.get(b"model_path", b"")) or None
        if version is not None and path is not None and version != self.engine.info.weight_version:
            await self.update(path, version)
