"""A spot fleet under preemption: goodput, makespan, lost and duplicated records.

    python -m benchmarks.spot [--workers 4] [--requests 32] [--tokens 2000] [--life-s 60] [--runs 3]
                              [--scale 10] [--curve 15,60,240] [--json-out spot.json]

N workers, real processes (``redroll worker`` on :mod:`benchmarks.spot_engine`, the synthetic
engine with a ledger outside the worker), run ``--requests`` generations of ``--tokens`` tokens
(``ignore_eos``), all submitted at once, under a preemption schedule: each worker's life is drawn
from an exponential distribution of mean ``--life-s`` (seeded: every mode of a run meets the same
draws); at the end of a life the worker is given notice (SIGTERM, then SIGKILL when the grace
period ``--grace-s`` is over) or killed at once (SIGKILL), and its replacement is started
``--replace-after-s`` after that moment, with a life of its own. Modes, in one run:

* ``none``: no preemption (the baseline);
* ``notice``: notice, continuation on (redroll's defaults);
* ``notice-restart``: notice, continuation off (a handed-back request starts over: what the
  peers do);
* ``kill``: SIGKILL, continuation on (a request continues from its last periodic checkpoint);
* ``kill-restart``: SIGKILL, continuation off.

Time is scaled down by ``--scale`` (10: a token every 3 ms instead of 30 ms, a 6 s mean life
instead of 60 s, a 2.5 s notice in a 3 s grace period instead of 25 s in 30 s, claim_idle 3 s,
checkpoints every 0.2 s and 32 tokens, heartbeats every 0.2 s): every figure below is given at
real scale (seconds × scale). What does not scale is a worker process's start (1 to 3 s here, as
Python imports; a GPU worker's is minutes).

Figures per mode: **goodput** (output tokens in the published records ÷ tokens the engines
decoded, counted by the ledger: a killed worker's generation counts from its start until its
death at the engine's pace), re-prefilled prompt tokens (the prompts of continuations and
restarts: prompt + saved tokens), **makespan** (submit to the last record), **lost** (requests
without a record) and **duplicated** (records beyond one a request), preemptions, and the fleet's
worker-seconds (each process from its start to its notice or death). Equal worker-seconds: a
replacement starts at the moment its predecessor is given notice (``--replace-after-s 0``), so each
of the N slots always holds one worker that claims (the one under notice claims nothing), less a
start-up. Three runs, median and range; then the curve of goodput against the preemption rate (one
run per mean life of ``--curve``). Not part of the test suite (a smoke run is: tests/test_spot_bench.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import redis.asyncio as aredis

from benchmarks.harness import median_range
from benchmarks.spot_engine import decoded_tokens
from redroll.producer.client import make_request, send
from redroll.shared.codec import decode_record
from redroll.shared.settings import Settings
from redroll.testing.embedded import start_redis_server

ROOT = Path(__file__).resolve().parent.parent
MODES = ("none", "notice", "notice-restart", "kill", "kill-restart")


@dataclass
class Process:
    """One worker process: a standby until its gate opens (it then claims), given notice or killed."""

    proc: subprocess.Popen
    gate: Path
    joined: float | None = None
    stopped: float | None = None
    """When it stopped claiming (its notice or death; the end of the run)."""


@dataclass
class Slot:
    """One place in the fleet: the workers that held it, one after the other."""

    lives: list[float]
    """Seconds each of its workers lives (drawn once per run: every mode meets the same)."""
    current: Process | None = None
    standby: Process | None = None
    all: list[Process] = field(default_factory=list)


@dataclass
class Fleet:
    args: argparse.Namespace
    mode: str
    settings: Settings
    workdir: Path
    deaths: dict[int, float] = field(default_factory=dict)
    preemptions: int = 0

    @property
    def ledger(self) -> Path:
        return self.workdir / f"{self.settings.namespace}.ledger"

    def env(self) -> dict[str, str]:
        a, k = self.args, self.args.scale
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1",
                   REDROLL_REDIS_URL=self.settings.redis_url, REDROLL_NAMESPACE=self.settings.namespace,
                   REDROLL_CLAIM_IDLE_MS=str(int(a.claim_idle_s * 1000 / k)), REDROLL_HEARTBEAT_S=str(2.0 / k),
                   REDROLL_CHECKPOINT_INTERVAL_S=str(2.0 / k), REDROLL_NOTICE_S=str(a.notice_s / k),
                   REDROLL_DRAIN_TIMEOUT_S=str(a.notice_s / k), REDROLL_LOG_LEVEL="warning")
        if self.mode.endswith("restart"):
            env["REDROLL_CONTINUATION"] = "0"
        return env

    def launch(self, slot: Slot, n: int) -> Process:
        """A standby for ``slot``: started now, claiming once :meth:`join` opens its gate."""
        a = self.args
        name = f"{self.mode}-{n}-{len(slot.all)}"
        gate = self.workdir / f"gate-{self.settings.namespace}-{name}"
        log = open(self.workdir / f"{self.settings.namespace}-{name}.log", "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "redroll.cli", "worker", "--engine", "benchmarks.spot_engine:LedgerEngine",
             "--engine-arg", f"ledger={self.ledger}", "--engine-arg", f"token_ms={a.token_ms / a.scale}",
             "--engine-arg", f"slots={a.slots}", "--engine-arg", f"gate={gate}", "--name", name],
            env=self.env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        process = Process(proc, gate)
        slot.all.append(process)
        return process

    async def join(self, process: Process) -> None:
        """Open the standby's gate (waiting until it is ready: a start-up longer than a life)."""
        ready = Path(str(process.gate) + ".ready")
        while not ready.exists():
            if process.proc.poll() is not None:
                raise RuntimeError(f"worker {process.gate.name} exited at start (see its log in {self.workdir})")
            await asyncio.sleep(0.01)
        process.gate.touch()
        process.joined = time.time()

    async def preempt(self, process: Process) -> None:
        self.preemptions += 1
        proc, now = process.proc, time.time()
        process.stopped = now
        if self.mode.startswith("kill"):
            proc.kill()
            self.deaths[proc.pid] = now
            return
        proc.send_signal(signal.SIGTERM)
        grace = self.args.grace_s / self.args.scale
        while proc.poll() is None and time.time() < now + grace:
            await asyncio.sleep(0.02)
        if proc.poll() is None:
            proc.kill()
        self.deaths[proc.pid] = time.time()

    async def run_slot(self, slot: Slot, n: int, done: asyncio.Event) -> None:
        a = self.args
        lives = iter(slot.lives if self.mode != "none" else [])
        pending: set[asyncio.Task] = set()
        while not done.is_set():
            life = next(lives, None)
            if life is None:
                await done.wait()
                break
            try:
                await asyncio.wait_for(done.wait(), life / a.scale)
                break
            except asyncio.TimeoutError:
                pass
            assert slot.current is not None and slot.standby is not None
            pending.add(asyncio.create_task(self.preempt(slot.current)))
            await asyncio.sleep(a.replace_after_s / a.scale)
            if done.is_set():
                break
            slot.current, slot.standby = slot.standby, None
            await self.join(slot.current)
            slot.standby = self.launch(slot, n)
        await asyncio.gather(*pending)


async def one_mode(args: argparse.Namespace, url: str, mode: str, lives: list[list[float]], workdir: Path) -> dict:
    settings = Settings(redis_url=url, namespace=f"spot-{mode}-{uuid.uuid4().hex[:6]}")
    fleet = Fleet(args, mode, settings, workdir)
    r = aredis.from_url(url)
    slots = [Slot(lives=list(x)) for x in lives]
    for n, slot in enumerate(slots):  # (every first worker, and a standby each, started before the clock)
        slot.current = fleet.launch(slot, n)
        if mode != "none":
            slot.standby = fleet.launch(slot, n)
    requests = [make_request(request_id=f"g-{i}", input_ids=[1 + i % 7, 2, 3],
                             sampling_params={"max_new_tokens": args.tokens, "ignore_eos": True})
                for i in range(args.requests)]
    for slot in slots:
        ready = Path(str(slot.current.gate) + ".ready")  # type: ignore[union-attr]
        while not ready.exists():
            await asyncio.sleep(0.02)
    done = asyncio.Event()
    started = time.time()
    await send(settings, r, requests)
    await asyncio.gather(*(fleet.join(slot.current) for slot in slots))  # type: ignore[arg-type]
    tasks = [asyncio.create_task(fleet.run_slot(slot, n, done)) for n, slot in enumerate(slots)]
    keys = settings.keys
    seen: dict[str, list] = {}
    last = "0-0"
    deadline = started + args.timeout_s
    while len(seen) < len(requests) and time.time() < deadline:
        got = await r.xread({keys.results: last}, count=500, block=200)
        for _, entries in got or ():
            for entry_id, fields in entries:
                last = entry_id
                record = decode_record(fields)
                seen.setdefault(record.request_id, []).append(record)
    ended = time.time()
    makespan = ended - started
    done.set()
    await asyncio.gather(*tasks)
    processes = [p for slot in slots for p in slot.all]
    for p in processes:
        if p.proc.poll() is None:
            if p.joined is not None and p.stopped is None:
                p.stopped = ended
            p.proc.send_signal(signal.SIGTERM)
    for p in processes:
        try:
            p.proc.wait(30)
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait()
        fleet.deaths.setdefault(p.proc.pid, time.time())
    await asyncio.sleep(0.3)  # (a late duplicate would show now)
    for _, entries in await r.xread({keys.results: last}, count=10_000) or ():
        for entry_id, fields in entries:
            record = decode_record(fields)
            seen.setdefault(record.request_id, []).append(record)
    await r.aclose()
    decoded, prefilled, generations = decoded_tokens(fleet.ledger.read_text() if fleet.ledger.exists() else "",
                                                     args.token_ms / args.scale, fleet.deaths)
    first = [records[0] for records in seen.values()]
    published = sum(len(ids) for record in first if record.status.value == "finished" for ids in record.output_token_ids)
    worker_s = sum((p.stopped or fleet.deaths[p.proc.pid]) - p.joined for p in processes if p.joined is not None)
    return {"mode": mode, "goodput": published / decoded if decoded else 0.0, "decoded_tokens": decoded,
            "published_tokens": published, "reprefilled_tokens": prefilled - 3 * len(requests),
            "generations": generations, "makespan_s": makespan * args.scale,
            "lost": len(requests) - len(seen), "duplicated": sum(len(x) - 1 for x in seen.values()),
            "not_finished": sum(1 for record in first if record.status.value != "finished"),
            "preemptions": fleet.preemptions, "worker_s": worker_s * args.scale}


def draw_lives(args: argparse.Namespace, seed: int, mean_s: float) -> list[list[float]]:
    rng = random.Random(seed)
    return [[rng.expovariate(1.0 / mean_s) for _ in range(64)] for _ in range(args.workers)]


async def one_run(args: argparse.Namespace, url: str, seed: int, modes: tuple[str, ...], mean_s: float,
                  workdir: Path) -> dict[str, dict]:
    lives = draw_lives(args, seed, mean_s)
    out = {}
    for mode in modes:
        out[mode] = await one_mode(args, url, mode, lives, workdir)
        print(json.dumps({"life_s": mean_s, "seed": seed, **out[mode]}), file=sys.stderr, flush=True)
    return out


def summarize(runs: list[dict[str, dict]], modes: tuple[str, ...]) -> dict:
    out: dict = {}
    for mode in modes:
        rows = [run[mode] for run in runs]
        out[mode] = median_range(rows, [k for k in rows[0] if k != "mode"])
    if "none" in modes and "notice" in modes:
        ratios = [run["notice"]["makespan_s"] / run["none"]["makespan_s"] for run in runs]
        out["notice_makespan_vs_none"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--slots", type=int, default=8, help="generations a worker runs at once (its engine's batch)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--token-ms", type=float, default=30.0, help="per request, at real scale")
    p.add_argument("--life-s", type=float, default=60.0, help="mean worker life, at real scale")
    p.add_argument("--notice-s", type=float, default=25.0, help="REDROLL_NOTICE_S, at real scale")
    p.add_argument("--grace-s", type=float, default=30.0, help="the grace period before SIGKILL, at real scale")
    p.add_argument("--claim-idle-s", type=float, default=30.0, help="claim_idle, at real scale")
    p.add_argument("--replace-after-s", type=float, default=0.0,
                   help="a replacement starts this long after its predecessor's notice or death, at real scale")
    p.add_argument("--scale", type=float, default=10.0, help="real time over benchmark time")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--curve", default="15,60,240",
                   help="mean lives (real seconds) for the goodput curve, one run each ('' for none)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="benchmark seconds a mode may take")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    modes = tuple(m for m in args.modes.split(",") if m)
    server = start_redis_server()
    workdir = Path(tempfile.mkdtemp(prefix="redroll-spot-"))
    try:
        runs = [asyncio.run(one_run(args, server.url, args.seed + i, modes, args.life_s, workdir))
                for i in range(args.runs)]
        curve = []
        for life in [float(x) for x in args.curve.split(",") if x.strip()]:
            run = asyncio.run(one_run(args, server.url, args.seed + 100, tuple(m for m in modes if m != "none"),
                                      life, workdir))
            curve.append({"life_s": life, "preemptions_per_worker_hour": 3600.0 / life,
                          **{mode: {"goodput": row["goodput"], "makespan_s": row["makespan_s"],
                                    "lost": row["lost"], "duplicated": row["duplicated"]}
                             for mode, row in run.items()}})
    finally:
        server.stop()
    report = {"args": vars(args), "runs": runs, "summary": summarize(runs, modes), "curve": curve,
              "workdir": str(workdir)}
    text = json.dumps(report, indent=1)
    if args.json_out:
        Path(args.json_out).write_text(text)
    print(text)
    return report


if __name__ == "__main__":
    main()
