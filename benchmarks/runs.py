"""One pipeline run: start workers and a consumer, wait until they are ready, produce, time it."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from benchmarks.harness import BenchError, Procs, Server, read_json, redroll_env, wait_for

PY = sys.executable
NAMESPACE = "bench"
"""Every run uses this namespace on a freshly emptied server (short keys, like a real deployment)."""
CONSUMER_GROUP = "bench"


def redroll_worker_argv(*, token_ms: float = 0.0, max_inflight: int = 256) -> list[str]:
    return [PY, "-m", "redroll.cli", "worker", "--engine", "synthetic", "--token-ms", str(token_ms),
            "--max-inflight", str(max_inflight)]


def bench_worker_argv(*, engine: str, max_inflight: int, slots: int = 32, token_ms: float = 10.0,
                      stats_out: Path | None = None) -> list[str]:
    argv = [PY, "-m", "benchmarks.proc_worker", "--engine", engine, "--slots", str(slots), "--token-ms",
            str(token_ms), "--max-inflight", str(max_inflight)]
    if stats_out is not None:
        argv += ["--stats-out", str(stats_out)]
    return argv


def consumer_argv(handler: str = "count", batch: int | None = None) -> list[str]:
    argv = [PY, "-m", "redroll.cli", "consume", "--group", CONSUMER_GROUP, "--handler",
            f"h=benchmarks.bench_handlers:{handler}"]
    if batch:
        argv += ["--batch", str(batch)]
    return argv


def producer_argv(count: int, out: Path, *, chunk: int = 500, rate: float = 0.0, max_new_tokens: int = 8,
                  n: int = 1, logprob: bool = False) -> list[str]:
    argv = [PY, "-m", "benchmarks.proc_producer", "--count", str(count), "--chunk", str(chunk), "--rate",
            str(rate), "--max-new-tokens", str(max_new_tokens), "--n", str(n), "--out", str(out)]
    if logprob:
        argv.append("--logprob")
    return argv


def group_exists(server: Server, stream: str, group: str) -> bool:
    try:
        return any(g["name"] in (group, group.encode()) for g in server.r.xinfo_groups(stream))
    except Exception:
        return False


@dataclass
class RunResult:
    count: int
    t_first: float
    t_last: float
    producer: dict
    consumer: dict
    cpu_s: dict[str, float]
    redis_cpu_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def elapsed(self) -> float:
        return self.t_last - self.t_first

    @property
    def rate(self) -> float:
        return self.count / self.elapsed if self.elapsed > 0 else float("nan")

    def cpu_us_per_item(self) -> dict[str, float]:
        out = {k: round(v * 1e6 / self.count, 1) for k, v in self.cpu_s.items()}
        out["redis-server"] = round(self.redis_cpu_s * 1e6 / self.count, 1)
        return out


def pipeline_run(server: Server, run_dir: Path, *, count: int, workers: Sequence[Sequence[str]],
                 producer: Sequence[str] | None, handler: str = "count", consumer_batch: int | None = None,
                 env: dict[str, Any] | None = None, timeout: float = 300.0, on_ready: Callable[[], Any] | None = None,
                 while_waiting: Callable[[], Any] | None = None, after_done: Callable[[Procs], Any] | None = None,
                 worker_env: list[dict[str, Any]] | None = None) -> RunResult:
    """Start ``workers`` and one consumer (handler ``benchmarks.bench_handlers:<handler>``), wait
    until every worker's heartbeat and the consumer group exist, then start ``producer`` (which
    must write its JSON to ``run_dir/producer.json``) and wait for the ``count``-th callback.

    ``on_ready`` runs just before the producer starts; with ``producer=None`` it produces instead
    (in this process) and returns the producer's report (``t_first``...).
    """
    server.fresh()
    keys_workers = "{" + NAMESPACE + "}:workers"
    results = "{" + NAMESPACE + "}:results"
    done_file = run_dir / "consumer.json"
    prod_file = run_dir / "producer.json"
    base_env = dict(env or {})
    with Procs(run_dir) as procs:
        for i, argv in enumerate(workers):
            wenv = dict(base_env)
            if worker_env:
                wenv.update(worker_env[i])
            procs.spawn(f"worker{i}", argv, redroll_env(server, NAMESPACE, **wenv))
        procs.spawn("consumer", consumer_argv(handler, consumer_batch),
                    redroll_env(server, NAMESPACE, BENCH_EXPECT=count, BENCH_DONE_FILE=done_file, **base_env))
        wait_for(lambda: server.r.hlen(keys_workers) >= len(workers), 60, "workers to register", procs=procs)
        wait_for(lambda: group_exists(server, results, CONSUMER_GROUP), 60, "the consumer group", procs=procs)
        time.sleep(0.2)  # let the consumer reach its first XREADGROUP
        cpu0 = procs.sample_cpu()
        rcpu0 = server.cpu_s()
        produced: dict = {}
        if on_ready is not None:
            produced = on_ready() or {}
        if producer is not None:
            procs.spawn("producer", producer, redroll_env(server, NAMESPACE, **base_env))
        last_poll = 0.0

        def finished() -> bool:
            nonlocal last_poll
            if while_waiting is not None and time.monotonic() - last_poll > 0.5:
                last_poll = time.monotonic()
                while_waiting()
            return done_file.exists()

        try:
            wait_for(finished, timeout, f"{count} callbacks", procs=procs, allow_exited=("producer",))
        except BenchError as exc:
            depth = server.r.xlen("{" + NAMESPACE + "}:requests")
            applied = read_json(done_file)
            raise BenchError(f"{exc} (request stream length {depth}, consumer file {applied})\n"
                             + "\n".join(f"--- {p.name}\n{p.tail(8)}" for p in procs.items)) from None
        cpu1 = procs.sample_cpu()
        rcpu1 = server.cpu_s()
        if producer is not None:
            wait_for(lambda: prod_file.exists(), 30, "the producer's report", procs=procs, allow_exited=("producer",))
            produced = read_json(prod_file) or {}
        consumed = read_json(done_file) or {}
        extra = after_done(procs) if after_done is not None else {}
        cpu = {k: cpu1[k] - cpu0.get(k, 0.0) for k in cpu1 if k != "producer"}
        if "cpu_s" in produced:
            cpu["producer"] = float(produced["cpu_s"])
    return RunResult(count=count, t_first=float(produced.get("t_first", consumed.get("t_first", 0.0))),
                     t_last=float(consumed["t_last"]), producer=produced, consumer=consumed,
                     cpu_s={k: round(v, 3) for k, v in cpu.items()}, redis_cpu_s=rcpu1 - rcpu0, extra=extra or {})


def queue_run(server: Server, run_dir: Path, count: int, *, chunk: int = 500, **kwargs: Any) -> RunResult:
    """The queue at its ceiling: a producer process sending ``count`` requests (``chunk`` per round
    trip), one ``redroll worker --engine synthetic --token-ms 0 --max-inflight 256``, one consumer."""
    return pipeline_run(server, run_dir, count=count, workers=[redroll_worker_argv(token_ms=0, max_inflight=256)],
                        producer=producer_argv(count, run_dir / "producer.json", chunk=chunk),
                        timeout=max(120, count / 50), **kwargs)
