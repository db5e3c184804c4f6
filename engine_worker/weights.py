"""Weight updates and engine memory: pause claiming, quiesce, act on the engine, resume.

A request may need newer weights than this worker serves (``min_weight_version``): it waits
here, parked and leased, until the update it needs lands.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

import redis

from redroll.engine_worker.context import WorkerContext
from redroll.engine_worker.flights import Flights
from redroll.ops.control import send_command
from redroll.shared.commands import (
    Command,
    CommandFailed,
    Pause,
    PauseMode,
    ReleaseMemory,
    Resume,
    ResumeMemory,
    UpdateMode,
    UpdateWeights,
)
from redroll.shared.streams import text
from redroll.shared.types import RecordStatus

log = logging.getLogger("redroll.worker")

AWAITING_PUSH = "awaiting push"
"""The claiming hold (and weight source) of a late joiner waiting for the trainer's next push."""

PAUSED = "paused"
"""The claiming hold of a paused fleet (the ``pause`` command, or ``{ns}:weights`` field ``paused``)."""


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
        self.lock = asyncio.Lock()
        """One weight change at a time (an update from disk, a trainer's push)."""
        self.pause_done = False
        """Paused as the pause's mode asked (``wait``: nothing runs any more); the heartbeat says
        ``paused`` from then on, ``pausing`` before."""
        self.source = "initial"
        """Where the served weights came from: ``initial``, ``disk:<path>``, ``push:<version>``, or
        ``awaiting push`` (a late joiner holding claims until the trainer's next push)."""

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
                await self.update(cmd.model_path, cmd.weight_version, mode=cmd.effective_mode)
            elif isinstance(cmd, ReleaseMemory):
                await self.release_memory()
            elif isinstance(cmd, ResumeMemory):
                await self.resume_memory()
            elif isinstance(cmd, Pause):
                await self.pause(cmd.mode)
            elif isinstance(cmd, Resume):
                await self.resume()
        except Exception as exc:
            await self.report_failure(cmd.kind, exc)

    async def report_failure(self, kind: str, exc: BaseException) -> None:
        log.error("control command %s failed: %s: %s", kind, type(exc).__name__, exc)
        try:
            await send_command(self.ctx.redis, self.ctx.keys, CommandFailed(
                worker=self.ctx.name, command=kind, error=f"{type(exc).__name__}: {exc}"[:500]))
        except redis.RedisError as report_exc:
            log.warning("could not report the failure of %s: %s", kind, report_exc)

    async def quiesce(self, hold: str, abort_inflight: bool = False) -> None:
        """Stop claiming and wait until nothing is in flight (aborting it first when asked)."""
        self.flights.hold(hold)
        if abort_inflight:
            for flight in self.flights:
                if flight.task is not None:  # deferred ones simply run later, on the new weights
                    flight.stop(self.engine, RecordStatus.ABORTED, "weight_update")
        await self.flights.wait_idle()

    def in_place_capable(self) -> bool:
        """The engine can swap weights under requests in flight (between two decode steps)."""
        caps = self.ctx.capabilities
        return caps.weights_from_disk and caps.weights_in_place

    async def update(self, model_path: str, weight_version: str | None, *, mode: UpdateMode = "quiesce") -> None:
        """Load new weights from ``model_path``. ``quiesce``: stop claiming, let in-flight requests
        finish, load, resume (records switch version at one point); ``abort``: abort them first (with
        collect_unfinished their partial output is published); ``in_place``: swap between two
        decode steps while they run (each token's version is in its record)."""
        async with self.lock:
            if weight_version is not None and weight_version == self.engine.info.weight_version:
                return
            if not self.ctx.capabilities.weights_from_disk:
                raise RuntimeError(f"the {self.engine.info.name} engine cannot load weights from disk (its "
                                   "capabilities do not declare weights_from_disk)")
            update = self.engine.update_weights_from_disk
            if mode == "in_place" and self.in_place_capable():
                log.info("weight update to %s (version %s), in place", model_path, weight_version)
                await update(model_path, weight_version, in_place=True)
                self.weights_changed(f"disk:{model_path}")
                await self._heartbeat()
                return
            log.info("weight update to %s (version %s): pausing claims", model_path, weight_version)
            await self.quiesce("weights", abort_inflight=mode == "abort")
            try:
                await update(model_path, weight_version)
                self.weights_changed(f"disk:{model_path}")
                await self._heartbeat()
            finally:
                self.flights.release("weights")

    def weights_changed(self, source: str) -> None:
        """New weights are served: requests parked for them start, a late joiner claims again."""
        self.source = source
        log.info("weights now at version %s (%s)", self.engine.info.weight_version, source)
        self.flights.release(AWAITING_PUSH)
        self.flights.resume_parked()

    async def release_memory(self) -> None:
        """Free engine memory for a colocated trainer; claiming stays paused until resume (and
        resumes at once when the engine refuses the release)."""
        await self.quiesce("memory")
        try:
            if self.ctx.capabilities.memory_release:  # (otherwise nothing to free: claiming pauses only)
                await self.engine.release_memory_occupation()
        except BaseException:
            self.flights.release("memory")
            raise
        finally:
            await self._heartbeat()

    async def resume_memory(self) -> None:
        if self.ctx.capabilities.memory_release:
            await self.engine.resume_memory_occupation()
        self.flights.release("memory")
        await self._heartbeat()

    async def pause(self, mode: PauseMode) -> None:
        """Stop claiming until :meth:`resume`: ``keep`` lets what runs go on; ``wait`` waits until it
        finished; ``abort`` aborts it first (a deferred entry waits, leased, in every mode)."""
        self.pause_done = False
        self.flights.hold(PAUSED)
        if mode != "keep":
            await self._heartbeat()  # ("pausing" until what runs is over)
            await self.quiesce(PAUSED, abort_inflight=mode == "abort")
        self.pause_done = PAUSED in self.flights.holds  # (a resume that came meanwhile wins)
        log.info("paused (%s)", mode)
        await self._heartbeat()

    async def resume(self) -> None:
        self.pause_done = False
        self.flights.release(PAUSED)
        log.info("resumed")
        await self._heartbeat()

    async def load_desired(self) -> None:
        """A worker that joins late never serves stale weights: it loads the last published
        checkpoint, or (weights pushed by a trainer, with no checkpoint on disk) claims nothing until
        the trainer's next push reaches it (``source`` says which)."""
        desired = await self.ctx.redis.hgetall(self.ctx.keys.weights)
        if not desired:
            return
        if text(desired.get(b"paused", b"")):  # (the fleet is paused: so is this worker, from its start)
            self.flights.hold(PAUSED)
            self.pause_done = True
        version = text(desired.get(b"weight_version", b"")) or None
        path = text(desired.get(b"model_path", b"")) or None
        if version is None or version == self.engine.info.weight_version:
            return
        if path is not None:
            await self.update(path, version)
            return
        self.source = AWAITING_PUSH
        self.flights.hold(AWAITING_PUSH)
        log.info("the fleet serves pushed weights %s and no checkpoint was published: claiming nothing until "
                 "the trainer's next push", version)
