"""Chaos harness: the delivery promises under real process failures (``tests/test_chaos.py`` runs
it reduced; ``python -m benchmarks.chaos`` is this module's command line).

Runs a whole pipeline as separate OS processes on a private redis-server (AOF on) and breaks it
while traffic flows:

- workers (synthetic engine, random per-request time so kills hit work in flight) are SIGKILLed
  every 1–3 s and restarted as new processes;
- consumers (group ``chaos``, a handler appending one JSON line per application to a file) are
  SIGKILLed and restarted;
- a worker is SIGSTOPped for longer than ``claim_idle``, then resumed (its late finishes must be
  fenced);
- redis-server itself is SIGKILLed and started again on the same port and AOF directory.

The harness audits the results stream through its own consumer group ``audit`` (every record,
counted per request_id), measures how long a killed worker's pending entries take to be finished
elsewhere, waits for quiescence, drains everything with SIGTERM and prints a JSON summary.
Exit code 0 iff no request was lost, none got two records, and every callback was applied.

    python -m benchmarks.chaos [--requests 5000] [--appendfsync always|everysec] [--json-out F]

Each process writes its output to ``<workdir>/logs``; the work directory is kept when the run
fails (or with ``--keep``) and its path is in the summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

import redis

from redroll.producer.client import make_request, send
from redroll.shared.connection import connect
from redroll.shared.keys import WORKERS_GROUP
from redroll.shared.scripts import DuplicateRequestError
from redroll.shared.settings import Settings
from redroll.shared.streams import ensure_group, text
from tests.support import poll
from tests.support.processes import redroll_argv, start_process
from tests.support.servers import RestartableRedis

ROOT = Path(__file__).resolve().parents[1]
APPLIED_ENV = "REDROLL_CHAOS_APPLIED"
CONSUMER_GROUP = "chaos"
AUDIT_GROUP = "audit"
AUDIT_CONSUMER = "harness"

log = logging.getLogger("redroll.chaos")


# ---------------------------------------------------------------------------- the consumers' handler

def apply_record(record: Any) -> None:
    """Callback run by the chaos consumers: one JSON line per application (O_APPEND, one write)."""
    line = json.dumps({"request_id": record.request_id, "status": record.status.value, "pid": os.getpid()})
    fd = os.open(os.environ[APPLIED_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- configuration, summary

@dataclass
class ChaosConfig:
    requests: int = 5000
    workers: int = 3
    consumers: int = 2
    token_ms: float = 20.0
    jitter: float = 0.8
    max_new_tokens: int = 10
    max_inflight: int = 16
    batch: int | None = None
    """Requests per send() (default: what keeps about 0.1 s between sends)."""
    send_seconds: float | None = None
    """Spread the sends over this long (default: the chaos schedule)."""
    worker_kills: int = 20
    consumer_kills: int = 3
    stops: int = 1
    redis_restarts: int = 1
    kill_interval: tuple[float, float] = (1.0, 3.0)
    redis_down_s: float = 0.5
    stop_s: float | None = None
    """How long a SIGSTOP lasts (default 2.5 x claim_idle)."""
    stop_calm_s: float | None = None
    """No worker kill for this long before a SIGSTOP (default 3 x claim_idle)."""
    stop_calm_max_s: float = 30.0
    """A SIGSTOP also waits (up to this long) until earlier kills have recovered."""
    claim_idle_ms: int = 1000
    affinity_lanes: int = 0
    """L > 0: requests carry an affinity key (one of 97 sessions) and queue on L lanes per partition."""
    resumable: bool = False
    """Requests are resumable (token-id prompts) and checkpointed every 2 tokens / 50 ms."""
    heartbeat_s: float = 0.3
    max_deliveries: int = 20
    drain_timeout_s: float = 5.0
    appendfsync: str = "always"
    duration_cap: float = 600.0
    """Upper bound on the whole run (traffic, chaos, quiescence)."""
    seed: int | None = None
    workdir: str | None = None
    keep: bool = False


@dataclass
class ChaosSummary:
    requests_submitted: int = 0
    records_published: int = 0
    callbacks_applied: int = 0
    lost: int = 0
    duplicate_records: int = 0
    duplicate_callback_applications: int = 0
    callbacks_missing: int = 0
    dead_letters: int = 0
    worker_kills: int = 0
    consumer_kills: int = 0
    stops: int = 0
    redis_restarts: int = 0
    max_recovery_s: float | None = None
    mean_recovery_s: float | None = None
    recoveries_measured: int = 0
    unrecovered_kills: int = 0
    stop_recovery_s: list[float] = field(default_factory=list)
    stop_takeovers: list[int] = field(default_factory=list)
    """Per SIGSTOP: how many of the stopped worker's entries the fleet took over while it slept."""
    fenced_finishes: int = 0
    """Finishes refused by the fence (lease lost), from the workers' last heartbeats."""
    appendfsync: str = "always"
    duration_s: float = 0.0
    quiesced: bool = False
    records_by_status: dict[str, int] = field(default_factory=dict)
    unclean_exits: list[str] = field(default_factory=list)
    examples: dict[str, list[str]] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    workdir: str | None = None
    ok: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False)


# ---------------------------------------------------------------------------- worker and consumer processes

@dataclass
class Proc:
    role: str
    slot: int
    gen: int
    popen: subprocess.Popen
    log_path: Path
    stopped: bool = False

    @property
    def label(self) -> str:
        return f"{self.role}{self.slot}.{self.gen}"

    @property
    def pid(self) -> int:
        return self.popen.pid


class Fleet:
    """Spawns, kills and restarts the workers and consumers (``python -m redroll.cli``)."""

    def __init__(self, cfg: ChaosConfig, env: dict[str, str], log_dir: Path):
        self.cfg = cfg
        self.env = env
        self.log_dir = log_dir
        self.workers: list[Proc] = []
        self.consumers: list[Proc] = []

    def _argv(self, role: str) -> list[str]:
        if role == "worker":
            return redroll_argv("worker", "--engine", "synthetic", "--token-ms", str(self.cfg.token_ms),
                           "--jitter", str(self.cfg.jitter), "--max-inflight", str(self.cfg.max_inflight))
        return redroll_argv("consume", "--group", CONSUMER_GROUP, "--handler", "apply=tests.chaos:apply_record")

    def _spawn(self, role: str, slot: int, gen: int) -> Proc:
        path = self.log_dir / f"{role}{slot}.{gen}.log"
        return Proc(role, slot, gen, start_process(self._argv(role), env=self.env, log=path), path)

    def start(self) -> None:
        self.workers = [self._spawn("worker", i, 0) for i in range(self.cfg.workers)]
        self.consumers = [self._spawn("consumer", i, 0) for i in range(self.cfg.consumers)]

    def kill_and_restart(self, proc: Proc) -> Proc:
        """SIGKILL ``proc`` and start a new process in its slot."""
        proc.popen.send_signal(signal.SIGKILL)
        proc.popen.wait()
        fresh = self._spawn(proc.role, proc.slot, proc.gen + 1)
        group = self.workers if proc.role == "worker" else self.consumers
        group[proc.slot] = fresh
        return fresh

    def running_workers(self) -> list[Proc]:
        return [w for w in self.workers if not w.stopped and w.popen.poll() is None]

    def shutdown(self, timeout: float) -> list[str]:
        """SIGTERM everything (a clean drain) and wait; returns 'label: code' for unclean exits."""
        procs = self.workers + self.consumers
        for p in procs:
            if p.stopped:
                p.popen.send_signal(signal.SIGCONT)
                p.stopped = False
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        unclean = []
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                code = p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                code = p.popen.wait()
                unclean.append(f"{p.label}: did not exit within {timeout:.0f}s")
                continue
            if code != 0:
                unclean.append(f"{p.label}: exit code {code}")
        return unclean


# ---------------------------------------------------------------------------- audit and applied log

class Audit:
    """Reads every record of the results stream through the harness's own consumer group."""

    def __init__(self, r: Any, stream: str):
        self.r = r
        self.stream = stream
        self.entries: dict[str, str] = {}
        """results entry id → request_id (entries are counted once even if read twice)."""
        self.records: Counter[str] = Counter()
        self.statuses: Counter[str] = Counter()

    async def setup(self) -> None:
        await ensure_group(self.r, self.stream, AUDIT_GROUP)

    async def poll(self, block_ms: int | None = None) -> int:
        """Read this consumer's pending entries (a reply lost to a crash) then new ones; ack them.

        Returns how many new entries ``>`` gave."""
        await self._read("0", None)
        return await self._read(">", block_ms)

    async def _read(self, start: str, block_ms: int | None) -> int:
        resp = await self.r.xreadgroup(AUDIT_GROUP, AUDIT_CONSUMER, {self.stream: start}, count=1000, block=block_ms)
        entries = [e for _s, es in (resp or []) for e in es]
        for raw_id, fields in entries:
            entry_id = text(raw_id)
            if not fields or entry_id in self.entries:
                continue
            rid = text(fields.get(b"rid", b"?"))
            self.entries[entry_id] = rid
            self.records[rid] += 1
            self.statuses[text(fields.get(b"status", b"?"))] += 1
        if entries:
            await self.r.xack(self.stream, AUDIT_GROUP, *[e[0] for e in entries])
        return len(entries)

    async def drain(self) -> None:
        """Read until nothing new is left (retrying through an outage)."""
        while await retrying(lambda: self.poll(None)):
            pass

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.poll(200)
            except Exception as exc:  # redis restarting: try again shortly
                log.debug("audit read failed: %s", exc)
                await asyncio.sleep(0.2)


class AppliedLog:
    """The consumers' applied file, read incrementally (whole lines only)."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.counts: Counter[str] = Counter()
        self.lines = 0

    def refresh(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1
        for line in chunk[:end].splitlines():
            if line.strip():
                self.counts[json.loads(line)["request_id"]] += 1
                self.lines += 1
        self.offset += end


async def retrying(call: Callable[[], Awaitable[Any]], attempts: int = 100, delay: float = 0.2) -> Any:
    """Await ``call()`` through a redis outage (the harness restarts redis on purpose)."""
    for i in range(attempts):
        try:
            return await call()
        except (redis.ConnectionError, redis.TimeoutError, OSError, redis.BusyLoadingError):
            if i == attempts - 1:
                raise
            await asyncio.sleep(delay)


# ---------------------------------------------------------------------------- producer

def request_ids(n: int, run_id: str) -> list[str]:
    return [f"chaos-{run_id}-{i:06d}" for i in range(n)]


def build_requests(ids: Sequence[str], max_new_tokens: int, keyed: bool = False,
                   resumable: bool = False) -> list[Any]:
    def prompt(rid: str) -> dict[str, Any]:
        if resumable:
            return {"input_ids": [1 + zlib.crc32(rid.encode()) % 1000, 2]}
        return {"prompt": f"chaos {rid}"}
    return [make_request(request_id=rid, callback="apply", resumable=resumable, **prompt(rid),
                         affinity_key=f"session-{zlib.crc32(rid.encode()) % 97}" if keyed else None,
                         sampling_params={"max_new_tokens": max_new_tokens}) for rid in ids]


async def unaccepted(r: Any, settings: Any, ids: Sequence[str], audit: Audit) -> list[str]:
    """After a failed send: the ids the server did not take (no live rid key and no record).

    The rid key lives from the submit to the finish, and the finish publishes the record in the
    same script, so checking the key first and then reading every record is race-free."""
    async def exists() -> list[int]:
        async with r.pipeline(transaction=False) as pipe:
            for rid in ids:
                pipe.exists(settings.keys.rid(rid))
            return await pipe.execute()

    live = await retrying(exists)
    await audit.drain()
    return [rid for rid, n in zip(ids, live) if not n and rid not in audit.records]


async def send_batch(r: Any, settings: Any, ids: list[str], cfg: ChaosConfig, audit: Audit) -> int:
    """``redroll.producer.client.send`` one batch; after a connection failure resend only what was not taken.

    Returns how many sends failed and had to be reconciled."""
    failures = 0
    while ids:
        try:
            await send(settings, r, build_requests(ids, cfg.max_new_tokens, keyed=cfg.affinity_lanes > 0,
                                                   resumable=cfg.resumable))
            return failures
        except (redis.ConnectionError, redis.TimeoutError, OSError, redis.BusyLoadingError,
                DuplicateRequestError) as exc:
            failures += 1
            log.warning("send of %d request(s) failed (%s); reconciling", len(ids), exc)
            await asyncio.sleep(0.2)
            ids = await unaccepted(r, settings, ids, audit)
    return failures


async def produce(r: Any, settings: Any, ids: list[str], cfg: ChaosConfig, audit: Audit, span_s: float,
                  submitted: list[str], shift: Callable[[], float] = lambda: 0.0) -> None:
    """Send ``ids`` in batches spread evenly over ``span_s`` seconds (plus ``shift()``: the chaos
    schedule's delays, so traffic keeps flowing until the last fault)."""
    loop = asyncio.get_running_loop()
    size = cfg.batch or max(1, min(500, round(len(ids) / max(1.0, span_s / 0.1))))
    batches = [ids[i:i + size] for i in range(0, len(ids), size)]
    interval = span_s / max(1, len(batches))
    t0 = loop.time()
    for k, batch in enumerate(batches):
        await asyncio.sleep(max(0.0, t0 + k * interval + shift() - loop.time()))
        await send_batch(r, settings, batch, cfg, audit)
        submitted.extend(batch)


# ---------------------------------------------------------------------------- recovery measurement

async def worker_name(r: Any, settings: Any, pid: int) -> str | None:
    """The consumer name of the worker process ``pid``, from its heartbeat."""
    best: tuple[float, str] | None = None
    for name, raw in (await r.hgetall(settings.keys.workers)).items():
        beat = json.loads(raw)
        if beat.get("pid") == pid and (best is None or beat.get("seen", 0) > best[0]):
            best = (beat.get("seen", 0), name.decode())
    return best[1] if best else None


Entry = tuple[str, str]
"""(request stream, entry id)"""


def request_streams(settings: Any) -> list[str]:
    """Every stream workers claim from (a priority stream too, where the pipeline has one)."""
    return list(getattr(settings.keys, "request_streams", [settings.keys.requests]))


async def pending_of(r: Any, settings: Any, consumer: str) -> list[Entry]:
    """The request entries ``consumer`` holds in group ``workers``."""
    out: list[Entry] = []
    for stream in request_streams(settings):
        try:
            rows = await r.xpending_range(stream, WORKERS_GROUP, min="-", max="+", count=100_000,
                                          consumername=consumer)
        except redis.ResponseError:  # no such stream or group (yet)
            continue
        out.extend((stream, text(p["message_id"])) for p in rows)
    return out


async def owners_of(r: Any, settings: Any, entries: Sequence[Entry]) -> list[str | None]:
    """The consumer owning each pending entry (None: not pending any more)."""
    async with r.pipeline(transaction=False) as pipe:
        for stream, i in entries:
            pipe.xpending_range(stream, WORKERS_GROUP, min=i, max=i, count=1)
        replies = await pipe.execute()
    return [text(rep[0]["consumer"]) if rep else None for rep in replies]


async def count_pending(r: Any, settings: Any, ids: Sequence[Entry]) -> int:
    return sum(1 for owner in await owners_of(r, settings, ids) if owner is not None)


async def fenced_total(r: Any, settings: Any) -> int:
    """Sum of the ``fenced`` counters in all heartbeats (killed workers' last beats included)."""
    beats = await r.hvals(settings.keys.workers)
    return sum(int(json.loads(b).get("fenced", 0)) for b in beats)


async def measure_recovery(r: Any, settings: Any, ids: list[Entry], t0: float, timeout: float) -> float | None:
    """Seconds from ``t0`` until none of ``ids`` is pending in group ``workers`` (None on timeout)."""
    while time.monotonic() - t0 < timeout:
        try:
            if await count_pending(r, settings, ids) == 0:
                return time.monotonic() - t0
        except Exception as exc:  # redis restarting
            log.debug("recovery poll failed: %s", exc)
        await asyncio.sleep(0.05)
    return None


# ---------------------------------------------------------------------------- chaos schedule

@dataclass(order=True)
class Event:
    at: float
    kind: str


def plan_events(cfg: ChaosConfig, rng: random.Random) -> tuple[list[Event], float]:
    """Worker kills every 1–3 s; the other faults spread over the same span. Returns (events, span).

    A SIGSTOP gets a calm stretch (no kill) before it and while it lasts, so the fleet is free to
    take the stopped worker's entries over (and its late finishes meet the fence) instead of still
    running the suspects of the last kill."""
    claim_idle_s = cfg.claim_idle_ms / 1000.0
    stop_slots = [round((i + 1) * cfg.worker_kills / (cfg.stops + 1)) for i in range(cfg.stops)]
    events, t = [], 0.0
    calm = cfg.stop_calm_s if cfg.stop_calm_s is not None else 3.0 * claim_idle_s
    stop_s = cfg.stop_s if cfg.stop_s is not None else 2.5 * claim_idle_s
    for k in range(cfg.worker_kills + 1):
        for _ in range(stop_slots.count(k)):
            t += calm
            events.append(Event(t, "stop"))
            t += stop_s
        if k < cfg.worker_kills:
            t += rng.uniform(*cfg.kill_interval)
            events.append(Event(t, "worker_kill"))
    span = max(t, 4.0 * claim_idle_s, 5.0)
    quiet = [(e.at - calm, e.at + stop_s) for e in events if e.kind == "stop"]
    for i in range(cfg.redis_restarts):
        at = span * (i + 1) / (cfg.redis_restarts + 1) + 0.3
        for lo, hi in quiet:  # not inside a SIGSTOP window: that one is about the fence
            at = hi + 0.5 if lo <= at <= hi else at
        events.append(Event(at, "redis_restart"))
    for i in range(cfg.consumer_kills):
        events.append(Event(span * (i + 0.5) / cfg.consumer_kills + 0.15, "consumer_kill"))
    return sorted(events), span


@dataclass
class ChaosState:
    worker_kills: int = 0
    consumer_kills: int = 0
    stops: int = 0
    redis_restarts: int = 0
    stop_takeovers: list[int] = field(default_factory=list)
    recoveries: list[asyncio.Task] = field(default_factory=list)
    stop_recoveries: list[asyncio.Task] = field(default_factory=list)
    resumes: list[asyncio.Task] = field(default_factory=list)


class Chaos:
    def __init__(self, cfg: ChaosConfig, fleet: Fleet, server: RestartableRedis, r: Any, settings: Any,
                 rng: random.Random):
        self.cfg, self.fleet, self.server, self.r, self.settings, self.rng = cfg, fleet, server, r, settings, rng
        self.state = ChaosState()
        self.recovery_timeout = 120.0
        self.shift = 0.0
        """Seconds the schedule was pushed back (a SIGSTOP waits for the fleet to be calm)."""

    async def run(self, events: list[Event], deadline: float) -> None:
        t0 = time.monotonic()
        for ev in events:
            at = t0 + ev.at + self.shift
            if at > deadline:
                log.warning("duration cap reached: %s at %.1fs skipped", ev.kind, ev.at)
                continue
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            try:
                await getattr(self, ev.kind)()
            except Exception:
                log.exception("chaos event %s failed", ev.kind)

    async def _victim_and_pending(self) -> tuple[Proc | None, list[Entry], str | None]:
        """A random running worker, its pending entry ids and its consumer name."""
        candidates = self.fleet.running_workers()
        if not candidates:
            return None, [], None
        named = []
        for w in candidates:
            name = await retrying(lambda: worker_name(self.r, self.settings, w.pid))
            if name is not None:
                named.append((w, name))
        if not named:
            return self.rng.choice(candidates), [], None
        victim, name = self.rng.choice(named)
        return victim, await retrying(lambda: pending_of(self.r, self.settings, name)), name

    async def worker_kill(self) -> None:
        victim, ids, _ = await self._victim_and_pending()
        if victim is None:
            return
        fresh = self.fleet.kill_and_restart(victim)
        t0 = time.monotonic()
        self.state.worker_kills += 1
        log.info("SIGKILL %s (pid %d, %d pending); restarted as %s (pid %d)", victim.label, victim.pid, len(ids),
                 fresh.label, fresh.pid)
        if ids:
            self.state.recoveries.append(asyncio.create_task(
                measure_recovery(self.r, self.settings, ids, t0, self.recovery_timeout)))

    async def consumer_kill(self) -> None:
        victim = self.rng.choice(self.fleet.consumers)
        fresh = self.fleet.kill_and_restart(victim)
        self.state.consumer_kills += 1
        log.info("SIGKILL %s (pid %d); restarted as %s (pid %d)", victim.label, victim.pid, fresh.label, fresh.pid)

    async def stop(self) -> None:
        # Calm first: the previous kills' suspects (each run alone) would otherwise keep the fleet
        # busy past the whole pause, and nothing of the stopped worker would be taken over.
        waited = time.monotonic()
        pending = [t for t in self.state.recoveries if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=self.cfg.stop_calm_max_s)
        self.shift += time.monotonic() - waited
        victim, ids, name = await self._victim_and_pending()
        if victim is None:
            return
        pause = self.cfg.stop_s if self.cfg.stop_s is not None else 2.5 * self.cfg.claim_idle_ms / 1000.0
        victim.popen.send_signal(signal.SIGSTOP)
        victim.stopped = True
        t0 = time.monotonic()
        self.state.stops += 1
        log.info("SIGSTOP %s (pid %d, %d pending) for %.1fs", victim.label, victim.pid, len(ids), pause)
        self.state.resumes.append(asyncio.create_task(self._resume(victim, pause, name, ids)))
        if ids:
            self.state.stop_recoveries.append(asyncio.create_task(
                measure_recovery(self.r, self.settings, ids, t0, self.recovery_timeout)))

    async def _resume(self, proc: Proc, after: float, name: str | None, ids: list[Entry]) -> None:
        await asyncio.sleep(after)
        taken = 0
        if name is not None and ids:
            owners = await retrying(lambda: owners_of(self.r, self.settings, ids))
            taken = sum(1 for o in owners if o != name)
        self.state.stop_takeovers.append(taken)
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGCONT)
        proc.stopped = False
        log.info("SIGCONT %s (pid %d); the fleet took over %d of its %d entries", proc.label, proc.pid, taken,
                 len(ids))

    async def redis_restart(self) -> None:
        started = time.monotonic()
        await asyncio.to_thread(self.server.crash_and_restart, self.cfg.redis_down_s)
        self.state.redis_restarts += 1
        log.info("redis-server SIGKILLed and restarted (AOF, appendfsync %s) in %.2fs", self.cfg.appendfsync,
                 time.monotonic() - started)


# ---------------------------------------------------------------------------- the run

def process_env(cfg: ChaosConfig, url: str, namespace: str, applied: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(REDROLL_REDIS_URL=url, REDROLL_NAMESPACE=namespace, REDROLL_CLAIM_IDLE_MS=str(cfg.claim_idle_ms),
               REDROLL_HEARTBEAT_S=str(cfg.heartbeat_s), REDROLL_MAX_DELIVERIES=str(cfg.max_deliveries),
               REDROLL_DRAIN_TIMEOUT_S=str(cfg.drain_timeout_s), REDROLL_LOG_LEVEL="info",
               REDROLL_AFFINITY_LANES=str(cfg.affinity_lanes),
               REDROLL_CHECKPOINT_TOKENS="2", REDROLL_CHECKPOINT_INTERVAL_S="0.05",
               REDROLL_CHECKPOINT_MIN_NEW_TOKENS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               PYTHONUNBUFFERED="1")
    env[APPLIED_ENV] = str(applied)
    return env


async def wait_for_fleet(r: Any, settings: Any, fleet: Fleet, timeout: float = 30.0) -> None:
    """Until every worker has a heartbeat and every consumer has started."""
    async def up() -> bool:
        names = [await worker_name(r, settings, w.pid) for w in fleet.workers]
        # (a consumer joins its group only on its first read of an entry: look for its start line)
        consumers_up = all(c.log_path.exists() and b" group " + CONSUMER_GROUP.encode() in c.log_path.read_bytes()
                           for c in fleet.consumers)
        return all(names) and consumers_up

    def none_exited() -> None:
        for p in fleet.workers + fleet.consumers:
            if p.popen.poll() is not None:
                raise RuntimeError(f"{p.label} exited with {p.popen.returncode} at start; see {p.log_path}")

    await poll.wait_until(up, timeout, 0.1, what="the fleet coming up", check=none_exited, error=RuntimeError)


async def wait_for_quiescence(audit: Audit, applied: AppliedLog, submitted: list[str], deadline: float) -> bool:
    """Until every submitted request has a record and an applied callback, or the deadline."""
    while time.monotonic() < deadline:
        applied.refresh()
        if all(rid in audit.records and rid in applied.counts for rid in submitted):
            return True
        await asyncio.sleep(0.2)
    return False


def summarize(cfg: ChaosConfig, submitted: list[str], audit: Audit, applied: AppliedLog, state: ChaosState,
              dead: int, recoveries: list[float | None], stop_recoveries: list[float | None], quiesced: bool,
              unclean: list[str], duration: float) -> ChaosSummary:
    lost = [rid for rid in submitted if rid not in audit.records]
    dup_records = [rid for rid, n in audit.records.items() if n > 1]
    dup_applied = [rid for rid, n in applied.counts.items() if n > 1]
    missing = [rid for rid in submitted if rid not in applied.counts]
    measured = [x for x in recoveries if x is not None]
    s = ChaosSummary(
        requests_submitted=len(submitted),
        records_published=sum(audit.records.values()),
        callbacks_applied=applied.lines,
        lost=len(lost),
        duplicate_records=len(dup_records),
        duplicate_callback_applications=len(dup_applied),
        callbacks_missing=len(missing),
        dead_letters=dead,
        worker_kills=state.worker_kills,
        consumer_kills=state.consumer_kills,
        stops=state.stops,
        redis_restarts=state.redis_restarts,
        max_recovery_s=round(max(measured), 3) if measured else None,
        mean_recovery_s=round(sum(measured) / len(measured), 3) if measured else None,
        recoveries_measured=len(measured),
        unrecovered_kills=len(recoveries) - len(measured),
        stop_recovery_s=[round(x, 3) for x in stop_recoveries if x is not None],
        stop_takeovers=list(state.stop_takeovers),
        appendfsync=cfg.appendfsync,
        duration_s=round(duration, 2),
        quiesced=quiesced,
        records_by_status=dict(sorted(audit.statuses.items())),
        unclean_exits=unclean,
        examples={k: v[:5] for k, v in (("lost", lost), ("duplicate_records", dup_records),
                                         ("duplicate_callbacks", dup_applied), ("callbacks_missing", missing)) if v},
        config={k: v for k, v in asdict(cfg).items() if k not in ("workdir", "keep")},
    )
    s.ok = s.lost == 0 and s.duplicate_records == 0 and s.callbacks_missing == 0 and s.requests_submitted == cfg.requests
    return s


async def run_chaos(cfg: ChaosConfig) -> ChaosSummary:
    """Run the whole experiment and return its summary (the work directory is kept on failure)."""
    seed = cfg.seed if cfg.seed is not None else random.randrange(2**31)
    cfg.seed = seed
    rng = random.Random(seed)
    workdir = Path(cfg.workdir or tempfile.mkdtemp(prefix="redroll-chaos-"))
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    (workdir / "redis").mkdir(exist_ok=True)
    harness_log = logging.FileHandler(workdir / "logs" / "harness.log")
    harness_log.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(harness_log)
    log.setLevel(logging.INFO)
    applied_path = workdir / "applied.jsonl"

    server = RestartableRedis(workdir / "redis", cfg.appendfsync)
    server.start()
    namespace = "chaos" + uuid.uuid4().hex[:8]
    settings = Settings(redis_url=server.url, namespace=namespace, claim_idle_ms=cfg.claim_idle_ms,
                        heartbeat_s=cfg.heartbeat_s, max_deliveries=cfg.max_deliveries,
                        affinity_lanes=cfg.affinity_lanes)
    r = connect(settings)
    fleet = Fleet(cfg, process_env(cfg, server.url, namespace, applied_path), workdir / "logs")
    audit, applied = Audit(r, settings.keys.results), AppliedLog(applied_path)
    stop_audit = asyncio.Event()
    summary: ChaosSummary | None = None
    try:
        await audit.setup()  # before any record exists: trimming then respects the audit group
        fleet.start()
        await wait_for_fleet(r, settings, fleet)
        started = time.monotonic()
        deadline = started + cfg.duration_cap
        events, span = plan_events(cfg, rng)
        chaos = Chaos(cfg, fleet, server, r, settings, rng)
        chaos.recovery_timeout = cfg.duration_cap
        submitted: list[str] = []
        ids = request_ids(cfg.requests, uuid.uuid4().hex[:6])
        audit_task = asyncio.create_task(audit.run(stop_audit))
        await asyncio.gather(
            produce(r, settings, ids, cfg, audit, cfg.send_seconds if cfg.send_seconds is not None else span,
                    submitted, lambda: chaos.shift),
            chaos.run(events, deadline))
        await asyncio.gather(*chaos.state.resumes)
        quiesced = await wait_for_quiescence(audit, applied, submitted, deadline)
        recoveries = await asyncio.gather(*chaos.state.recoveries)
        stop_recoveries = await asyncio.gather(*chaos.state.stop_recoveries)
        await asyncio.sleep(2 * cfg.heartbeat_s)  # let the last heartbeats carry the final counters
        fenced = await retrying(lambda: fenced_total(r, settings))
        unclean = await asyncio.to_thread(fleet.shutdown, cfg.drain_timeout_s + 20)
        stop_audit.set()
        await audit_task
        await audit.drain()  # anything published late (a duplicate would show here)
        applied.refresh()
        dead = await retrying(lambda: r.xlen(settings.keys.dead))
        summary = summarize(cfg, submitted, audit, applied, chaos.state, dead, recoveries, stop_recoveries,
                            quiesced, unclean, time.monotonic() - started)
        summary.fenced_finishes = fenced
        return summary
    finally:
        stop_audit.set()
        await asyncio.to_thread(fleet.shutdown, 5)
        await r.aclose()
        server.stop()
        logging.getLogger().removeHandler(harness_log)
        harness_log.close()
        if summary is not None and summary.ok and not cfg.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        elif summary is not None:
            summary.workdir = str(workdir)
        else:
            print(f"chaos run failed; logs kept in {workdir}", file=sys.stderr)


# ---------------------------------------------------------------------------- command line

def build_parser() -> argparse.ArgumentParser:
    d = ChaosConfig()
    p = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--workers", type=int, default=d.workers)
    p.add_argument("--consumers", type=int, default=d.consumers)
    p.add_argument("--token-ms", type=float, default=d.token_ms)
    p.add_argument("--jitter", type=float, default=d.jitter)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--max-inflight", type=int, default=d.max_inflight)
    p.add_argument("--batch", type=int, default=None, help="requests per send() (default: one send every ~0.1 s)")
    p.add_argument("--send-seconds", type=float, default=None,
                   help="spread the sends over this long (default: the length of the chaos schedule)")
    p.add_argument("--worker-kills", type=int, default=d.worker_kills, help="worker SIGKILLs, one every 1-3 s")
    p.add_argument("--consumer-kills", type=int, default=d.consumer_kills)
    p.add_argument("--stops", type=int, default=d.stops, help="worker SIGSTOPs for 2.5 x claim_idle")
    p.add_argument("--redis-restarts", type=int, default=d.redis_restarts)
    p.add_argument("--redis-down-s", type=float, default=d.redis_down_s,
                   help="how long redis-server stays down at each restart")
    p.add_argument("--stop-s", type=float, default=None, help="SIGSTOP length (default 2.5 x claim_idle)")
    p.add_argument("--stop-calm-s", type=float, default=None,
                   help="no worker kill for this long before a SIGSTOP (default 3 x claim_idle)")
    p.add_argument("--claim-idle-ms", type=int, default=d.claim_idle_ms)
    p.add_argument("--resumable", action="store_true",
                   help="resumable requests, checkpointed every 2 tokens / 50 ms (token-id prompts)")
    p.add_argument("--affinity-lanes", type=int, default=d.affinity_lanes,
                   help="run with affinity lanes: requests carry a session key (default 0 = off)")
    p.add_argument("--heartbeat-s", type=float, default=d.heartbeat_s)
    p.add_argument("--max-deliveries", type=int, default=d.max_deliveries)
    p.add_argument("--appendfsync", choices=["always", "everysec"], default=d.appendfsync)
    p.add_argument("--duration-cap", type=float, default=d.duration_cap, help="seconds for the whole run")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--workdir", default=None, help="where logs, the AOF and the applied file go (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work directory even when the run passes")
    p.add_argument("--json-out", default=None, help="also write the summary here")
    p.add_argument("--verbose", action="store_true", help="log chaos events to stderr")
    return p


def config_from_args(args: argparse.Namespace) -> ChaosConfig:
    names = set(ChaosConfig.__dataclass_fields__)
    return ChaosConfig(**{k: v for k, v in vars(args).items() if k in names})


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.INFO if args.verbose else logging.WARNING)
    console.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(console)
    summary = asyncio.run(run_chaos(config_from_args(args)))
    text = summary.to_json()
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
