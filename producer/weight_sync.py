"""A trainer pushes its weights to the fleet: tensors broadcast over torch.distributed, the way RL
trainers do it, announced on the control stream and safe against dead workers.

    async with producer.weight_sync(backend="gloo") as sync:
        await sync.push(model.named_parameters(), version="12")

One push, attempt by attempt: the trainer (rank 0) names a fresh weight-update group (its own
address, a free port) and the live workers' ranks in a ``sync_weights`` command; it serves the
rendezvous and waits until every named worker joined; it broadcasts the tensors in order; the
workers receive them into staging and report ``received`` in the push's progress hash; then the
trainer commits (``sync_commit``), sets the desired weights in ``{ns}:weights`` (so a worker that
joins later does not serve stale ones), and returns once every worker reports ``committed``.

A worker that dies mid-broadcast fails the collective at once on the trainer's side (gloo:
"Connection closed by peer"); the trainer aborts the attempt (``sync_abort``: the survivors drop
what they staged) and closes its group, which ends the survivors' pending collectives too, then
repeats the push for the workers that reported back, on a fresh group (new name and port). Every
collective has a timeout, so no dead peer hangs the trainer; the dead worker's requests are
reclaimed by the fleet as usual. The collectives run in a thread: the trainer's event loop (its
producer, its reply readers) goes on.

The rendezvous is a plain TCPStore: not authenticated. It binds to the trainer's own address
(``address``; default: the address this host reaches Redis from), which only the fleet should
reach. The NCCL path (GPU tensors, ``backend="nccl"``) is untested here: it needs one GPU per rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable
from urllib.parse import urlsplit

from redroll.ops.control import live_workers, send_command
from redroll.shared.commands import SyncAbort, SyncCommit, SyncWeights, TensorSpec, UpdateMode
from redroll.shared.errors import RedrollError
from redroll.shared.streams import text
from redroll.shared.weight_group import WeightGroup, dtype_name

log = logging.getLogger("redroll.producer")


class WeightSyncError(RedrollError, RuntimeError):
    """A push that did not reach the fleet after every attempt (the message says why)."""


@dataclass
class PushReport:
    version: str
    workers: list[str]
    """The workers that took the new weights."""
    attempts: int
    seconds: float
    excluded: list[str] = field(default_factory=list)
    """Workers left out after an attempt failed without a word from them (dead, most likely)."""
    tensors: int = 0
    bytes: int = 0


def local_address(redis_url: str) -> str:
    """The address of this host that reaches ``redis_url`` (loopback for a local Redis)."""
    host = urlsplit(redis_url).hostname or "127.0.0.1"
    if host in ("localhost", "127.0.0.1", "::1") or urlsplit(redis_url).scheme == "unix":
        return "127.0.0.1"
    port = urlsplit(redis_url).port or 6379
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


class WeightSync:
    def __init__(self, producer: Any, *, backend: str = "gloo", address: str | None = None, port: int | None = None,
                 mode: UpdateMode = "in_place", timeout_s: float = 60.0, attempts: int = 3,
                 stale_after_s: float = 10.0):
        """``mode``: how workers take the new weights (``in_place``: between two decode steps, while
        requests run; ``quiesce``: after their in-flight work; ``abort``). ``timeout_s`` bounds the
        rendezvous and every collective, on both sides."""
        self.producer = producer
        self.backend = backend
        self.address = address or local_address(producer.settings.redis_url)
        self.port = port
        self.mode = mode
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.stale_after_s = stale_after_s

    async def __aenter__(self) -> "WeightSync":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        return None

    async def push(self, named_tensors: Iterable[tuple[str, Any]], version: str, *,
                   checkpoint_path: str | None = None) -> PushReport:
        """Broadcast ``named_tensors`` (e.g. ``model.named_parameters()``) to every live worker as
        weight version ``version``; returns when every one of them serves it. ``checkpoint_path``:
        where the same weights are on disk, if anywhere (workers that join later load them)."""
        started = time.monotonic()
        tensors = [(name, self._sendable(t)) for name, t in named_tensors]
        specs = [TensorSpec(name, dtype_name(t.dtype), list(t.shape)) for name, t in tensors]
        sync_id = uuid.uuid4().hex[:12]
        excluded: set[str] = set()
        last_error: BaseException | None = None
        for attempt in range(1, self.attempts + 1):
            workers = {n: b for n, b in (await live_workers(self.producer.redis, self.producer.keys, self.stale_after_s)).items()
                       if n not in excluded}
            if not workers:
                await self._set_desired(version, checkpoint_path)
                return PushReport(version, [], attempt, time.monotonic() - started, sorted(excluded))
            try:
                names = await self._attempt(sync_id, attempt, version, workers, tensors, specs, checkpoint_path)
            except Exception as exc:
                last_error = exc
                gone = await self._after_failure(sync_id, attempt, workers)
                excluded |= gone
                log.warning("weight push %s (version %s) attempt %d failed: %s: %s; %s", sync_id, version, attempt,
                            type(exc).__name__, exc, f"leaving out {sorted(gone)}" if gone else "repeating it")
                continue
            await self._set_weight_version(version)
            return PushReport(version, names, attempt, time.monotonic() - started, sorted(excluded),
                              tensors=len(tensors), bytes=sum(t.numel() * t.element_size() for _, t in tensors))
        raise WeightSyncError(f"weight push of version {version} failed after {self.attempts} attempts: {last_error}")

    def _sendable(self, tensor: Any) -> Any:
        t = tensor.detach()
        if self.backend == "gloo":
            t = t.cpu()
        return t.contiguous()

    async def _attempt(self, sync_id: str, attempt: int, version: str, workers: dict[str, dict],
                       tensors: list, specs: list[TensorSpec], checkpoint_path: str | None) -> list[str]:
        ranks, next_rank = {}, 1
        for name in sorted(workers):
            ranks[name] = next_rank
            next_rank += max(1, int(workers[name].get("weight_ranks") or 1))
        port = self.port or free_port(self.address)
        group_name = f"redroll-{sync_id}-{attempt}"
        await send_command(self.producer.redis, self.producer.keys, SyncWeights(
            sync_id=sync_id, attempt=attempt, version=version, group_name=group_name, master_address=self.address,
            master_port=port, world_size=next_rank, backend=self.backend, ranks=ranks, tensors=specs,
            mode=self.mode, timeout_s=self.timeout_s, checkpoint_path=checkpoint_path))
        group: WeightGroup | None = None
        try:
            group = await asyncio.to_thread(WeightGroup.open, address=self.address, port=port, rank=0,
                                            world_size=next_rank, name=group_name, backend=self.backend,
                                            timeout_s=self.timeout_s)

            def broadcast_all() -> None:
                for _, tensor in tensors:
                    group.broadcast(tensor, 0)  # type: ignore[union-attr]

            await asyncio.to_thread(broadcast_all)
            await self._wait_for(sync_id, attempt, ranks, "received")
            await send_command(self.producer.redis, self.producer.keys, SyncCommit(sync_id=sync_id, attempt=attempt, version=version))
            await self._set_desired(version, checkpoint_path)
            await self._wait_for(sync_id, attempt, ranks, "committed")
            return sorted(ranks)
        except BaseException:
            with contextlib.suppress(Exception):
                await send_command(self.producer.redis, self.producer.keys, SyncAbort(sync_id=sync_id, attempt=attempt,
                                                                       reason="the trainer's side failed"))
            raise
        finally:
            if group is not None:
                await asyncio.to_thread(group.close)  # (the survivors' pending collectives end now)

    async def _progress(self, sync_id: str, attempt: int) -> dict[str, str]:
        raw = await self.producer.redis.hgetall(self.producer.keys.weight_sync(sync_id))
        suffix = f":{attempt}"
        return {text(k)[: -len(suffix)]: text(v) for k, v in raw.items() if text(k).endswith(suffix)}

    async def _wait_for(self, sync_id: str, attempt: int, ranks: dict[str, int], want: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            progress = await self._progress(sync_id, attempt)
            failed = {w: s for w, s in progress.items() if w in ranks and s.startswith("failed")}
            if failed:
                raise WeightSyncError(f"workers failed the push: {failed}")
            if all(progress.get(w) in (want, "committed") for w in ranks):
                return
            if time.monotonic() > deadline:
                behind = sorted(w for w in ranks if progress.get(w) != want)
                raise TimeoutError(f"workers not {want} after {self.timeout_s:.0f}s: {behind}")
            await asyncio.sleep(0.02)

    async def _after_failure(self, sync_id: str, attempt: int, workers: dict[str, dict]) -> set[str]:
        """The workers to leave out of the next attempt: those that said nothing conclusive once the
        survivors had time to notice (their collectives fail as soon as the trainer's group closes)."""
        concluded = ("failed", "discarded", "received", "committed")
        deadline = time.monotonic() + min(self.timeout_s, 10.0)
        quiet_s = max(3 * self.producer.settings.heartbeat_s, 1.0)
        while True:
            progress = await self._progress(sync_id, attempt)
            silent = {w for w in workers if not progress.get(w, "").startswith(concluded)}
            if not silent or time.monotonic() > deadline:
                return silent
            # A silent worker whose heartbeat stopped too is gone (a SIGKILL): no need to wait on.
            beats = await live_workers(self.producer.redis, self.producer.keys, quiet_s)
            if not silent & set(beats):
                return silent
            await asyncio.sleep(0.05)

    async def _set_desired(self, version: str, checkpoint_path: str | None) -> None:
        """``{ns}:weights``: what a worker that joins later must serve (a checkpoint to load, or wait)."""
        await self.producer.redis.hset(self.producer.keys.weights, mapping={
            "weight_version": version, "model_path": checkpoint_path or "", "source": "push",
            "updated_at": str(time.time())})

    async def _set_weight_version(self, version: str) -> None:
        if str(version).isdigit():
            self.producer.set_weight_version(int(version))
