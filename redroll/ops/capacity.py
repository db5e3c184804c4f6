"""How many GPUs one Redis primary carries: the capacity model behind ``redroll capacity``.

Redis runs commands on one core, so a pipeline's ceiling is the CPU its primary spends per second
of the fleet's work. Per GPU, with ``T`` tokens/s, completions of ``L`` tokens, ``c`` requests
decoding at once and ``w`` workers::

    requests/s            R = T / L
    streamed chunks/s     K = T / k,  k = min(stream_chunk_tokens, max(1, (T / c) x (stream_chunk_ms + e) / 1000))
    chunk writes/s        C = min(K, w x 1000 / max(20, min(stream_chunk_ms + e, 1000 x k / (T / c))))
    checkpoints/s         P = c / max(checkpoint_tokens / (T / c), checkpoint_interval_s)   (continued, not streamed)
    Redis CPU (µs/s)      U = R x request_us + C x chunk_call_us + K x chunk_us + P x checkpoint_us
                              + w x idle_worker_us
    GPUs one primary carries at a share u of its core:   N = u x 1,000,000 / U

A streamed request's chunks checkpoint it too, so streaming and checkpoints are not both counted;
``e`` is what the worker adds to the chunk timer (it looks every 20 ms and times the next chunk from
the end of a write). A worker writes all the chunks due at one look in one call (its streams' timers
beat together), so a chunk costs ``chunk_us`` and each write ``chunk_call_us`` more, whatever the
number of chunks in it: its lease read, the producer's chunk stream entry, the reader's wake. On a Redis Cluster with ``S`` shards (the pipeline's partitions spread over
them), the per-request, chunk and checkpoint work divides S ways, while the heartbeats and the
control stream (the ``{ns}`` keys: the idle part) stay on one shard::

    N(S) = u x 1,000,000 / ((R x request_us + C x chunk_call_us + K x chunk_us + P x checkpoint_us) / S
                            + w x idle_worker_us)

The constants are measured by the project's benchmarks on its own machine (:data:`CONSTANTS`
says which figure came from which run); measure yours with the same commands and pass them as
flags. They are Redis's CPU (``INFO cpu``), not its command time: a command's parsing, its reply
and the event loop count too.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from redroll.shared.settings import Settings

MILLION = 1_000_000.0


@dataclass(frozen=True)
class Constant:
    """A measured cost, with where it came from."""

    value: float
    unit: str
    source: str
    """The benchmark, figure and runs it came from (rerun that command to measure your own)."""


CONSTANTS: dict[str, Constant] = {
    "request_us": Constant(
        294.5, "µs of redis-server CPU per request at a GPU fleet's pace (each worker finishing a few a second, "
               "each call carrying one or two): submit, claim, fenced finish and record, the producer's read "
               "and ack",
        "python -m benchmarks.capacity_check --measure: request_us (64 synthetic workers, 4 requests each at once, "
        "15 ms a token, 96-token requests awaited with Producer.generate: Redis CPU over the idle fleet's, per "
        "request), median of 3 runs (237.2-315.8), 2026-12-06, this project's machine (2 cores, load under 1; 173-190 "
        "earlier the same day, when the machine ran about a third faster); "
        "at the ceiling, with hundreds a call, a request costs 25-31 µs (benchmarks.bench --only ceiling)"),
    "chunk_us": Constant(
        3.3, "µs of redis-server CPU per streamed chunk in a write: its fields in the producer's chunk stream "
                  "entry and the worker's parts stream entry (it checkpoints the request too), its share of the "
                  "reader's read",
        "python -m benchmarks.capacity_check --measure: chunk_us (the same fleet streaming 4 and 1 requests a "
        "worker, every chunk read: Redis CPU over the idle fleet's, less the requests', the difference over "
        "the difference in chunks written), median of 3 runs (3.1-9.3), 2026-12-06"),
    "chunk_call_us": Constant(
        111.4, "µs of redis-server CPU per write of chunks (one a worker's look, whatever the chunks in it): "
                       "the function call and its lease read, the producer's chunk stream entry, the parts stream entry, "
                       "the reader's wake",
        "python -m benchmarks.capacity_check --measure: chunk_call_us (what the streamed fleet's Redis CPU "
        "leaves of its 1-a-worker run once its chunks are paid, per write: 64 workers each writing every "
        "stream_chunk_ms + e), median of 3 runs (96.4-113.1), 2026-12-06"),
    "chunk_timer_extra_ms": Constant(
        16.9, "ms the worker adds to stream_chunk_ms (it looks every 20 ms; the streams' timers beat together)",
        "python -m benchmarks.capacity_check --measure: 1000 x tokens a chunk / tokens a second of a stream, "
        "less stream_chunk_ms (50), median of 3 runs (13.4-17.7), 2026-12-06"),
    "checkpoint_us": Constant(
        5.7, "µs of redis-server CPU per checkpoint of a request that is not streamed",
        "python -m benchmarks.checkpoint_cost: 0.0255 µs (0.015-0.030) of Redis CPU per checkpointed token x 222 "
        "tokens a checkpoint (128 generations of 2,000 tokens at 10 ms a token on one worker, checkpoints on "
        "against off, median of 3 paired runs, quiet machine), 2026-12-06; a worker's saves of one tick are "
        "one call, so a worker with fewer requests at once pays more a save"),
    "idle_worker_us": Constant(
        24.0, "µs of redis-server CPU per second per worker: heartbeat, blocking reads, reclaim passes",
        "python -m benchmarks.fleet --workers 1024: idle_redis_cpu_1024w_lanes_off (1,024 idle workers in 8 "
        "processes: 2.66% of a core, median of 3 runs, 2.54-3.51) less an empty server's own CPU (0.2%), per "
        "worker (23-32), 2026-12-06; with affinity lanes on about 45"),
}
"""The model's inputs as measured here. The per-chunk figure changes with how chunks are written
(one call per worker tick batches them): rerun ``python -m benchmarks.capacity_check --measure``."""


@dataclass(frozen=True)
class Workload:
    tokens_per_s: float
    """Output tokens per second per GPU."""
    completion_tokens: float
    """Tokens per completion (per request)."""
    concurrency: int = 64
    """Requests decoding at once per GPU (sets each stream's speed, hence its chunk size)."""
    stream: bool = False
    continuation: bool = True
    """Requests continue after a hand-back or a death, so they checkpoint their output (the workers'
    ``continuation`` setting, on by default, for single-sample requests; streamed ones always, through
    their chunks). False: nothing is saved but streamed requests' chunks."""
    workers_per_gpu: float = 1.0
    stream_chunk_tokens: int = Settings.stream_chunk_tokens
    stream_chunk_ms: float = Settings.stream_chunk_ms
    checkpoint_tokens: int = Settings.checkpoint_tokens
    checkpoint_interval_s: float = Settings.checkpoint_interval_s
    checkpoint_min_new_tokens: int = Settings.checkpoint_min_new_tokens
    """Requests of fewer tokens are never checkpointed (the worker's setting)."""

    def __post_init__(self) -> None:
        for name in ("tokens_per_s", "completion_tokens", "concurrency", "workers_per_gpu", "stream_chunk_tokens",
                     "checkpoint_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0")
        if self.stream_chunk_ms < 0 or self.checkpoint_interval_s < 0:
            raise ValueError("stream_chunk_ms and checkpoint_interval_s: must be >= 0")


@dataclass(frozen=True)
class Estimate:
    workload: Workload
    constants: dict[str, float]
    share_of_core: float
    requests_per_s: float
    tokens_per_chunk: float
    chunks_per_s: float
    chunk_writes_per_s: float
    checkpoints_per_s: float
    per_gpu_us: dict[str, float]
    """Redis CPU per GPU per second, by part (µs)."""
    gpus: float
    """GPUs one primary carries at ``share_of_core`` of its core."""
    shards: dict[int, float] = field(default_factory=dict)
    """Cluster shards -> GPUs the cluster carries."""

    @property
    def per_gpu_total_us(self) -> float:
        return sum(self.per_gpu_us.values())

    def to_json(self) -> dict[str, Any]:
        return {"workload": vars(self.workload), "constants": self.constants, "share_of_core": self.share_of_core,
                "requests_per_s_per_gpu": self.requests_per_s, "tokens_per_chunk": self.tokens_per_chunk,
                "chunks_per_s_per_gpu": self.chunks_per_s, "chunk_writes_per_s_per_gpu": self.chunk_writes_per_s,
                "checkpoints_per_s_per_gpu": self.checkpoints_per_s,
                "redis_us_per_s_per_gpu": self.per_gpu_us, "redis_us_per_s_per_gpu_total": self.per_gpu_total_us,
                "gpus_per_primary": self.gpus, "gpus_by_shards": {str(k): v for k, v in self.shards.items()}}


def constants(**overrides: float | None) -> dict[str, float]:
    """:data:`CONSTANTS`' values, with any given (not None) in their place."""
    out = {name: c.value for name, c in CONSTANTS.items()}
    for name, value in overrides.items():
        if name not in out:
            raise KeyError(f"no capacity constant {name!r}")
        if value is not None:
            if value < 0:
                raise ValueError(f"{name}: must be >= 0")
            out[name] = float(value)
    return out


def tokens_per_chunk(w: Workload, extra_ms: float = 0.0) -> float:
    """A chunk goes every ``stream_chunk_tokens`` tokens or every ``stream_chunk_ms`` with at least
    one new token, whichever comes first: at a stream's speed, this many tokens a chunk. The worker
    looks every 20 ms and starts the next interval once a write returned, which stretches the timer
    by ``extra_ms`` (measured: the constant ``chunk_timer_extra_ms``)."""
    per_stream = w.tokens_per_s / w.concurrency
    return min(float(w.stream_chunk_tokens), max(1.0, per_stream * (w.stream_chunk_ms + extra_ms) / 1000.0))


def chunk_writes_per_s(w: Workload, per_chunk: float, extra_ms: float = 0.0) -> float:
    """A worker's writes of chunks a second (per GPU): one at each look (every 20 ms) where a
    stream's chunk is due, which is every ``stream_chunk_ms`` + ``extra_ms`` or every ``per_chunk``
    tokens of a stream, whichever comes first; never more than the chunks."""
    per_stream = w.tokens_per_s / w.concurrency
    every_ms = max(LOOK_MS, min(w.stream_chunk_ms + extra_ms, 1000.0 * per_chunk / per_stream))
    return min(w.tokens_per_s / per_chunk, w.workers_per_gpu * 1000.0 / every_ms)


LOOK_MS = 20.0
"""How often a worker looks at its requests' output for chunks due (its checkpoint writer's tick)."""


def checkpoints_per_s(w: Workload) -> float:
    """Checkpoint writes per GPU per second: a request that continues saves every
    ``checkpoint_tokens`` tokens or ``checkpoint_interval_s``, whichever comes later, when it has at
    least ``checkpoint_min_new_tokens`` to make (none otherwise)."""
    if not w.continuation or w.stream or w.completion_tokens < w.checkpoint_min_new_tokens:
        return 0.0
    per_stream = w.tokens_per_s / w.concurrency
    every_s = max(w.checkpoint_tokens / per_stream, w.checkpoint_interval_s)
    # (saves within a completion: the last part goes with its finish, not in a checkpoint)
    per_request = max(0.0, (w.completion_tokens / per_stream) / every_s - 1.0) if every_s > 0 else 0.0
    return per_request * w.tokens_per_s / w.completion_tokens


def estimate(w: Workload, *, share_of_core: float = 0.8, shards: tuple[int, ...] = (1, 2, 4, 8),
             **overrides: float | None) -> Estimate:
    """The model for workload ``w`` (see the module's docstring)."""
    if not 0 < share_of_core <= 1:
        raise ValueError("share_of_core: must be in (0, 1]")
    k = constants(**overrides)
    requests = w.tokens_per_s / w.completion_tokens
    per_chunk = tokens_per_chunk(w, k["chunk_timer_extra_ms"]) if w.stream else 0.0
    chunks = w.tokens_per_s / per_chunk if w.stream else 0.0
    writes = chunk_writes_per_s(w, per_chunk, k["chunk_timer_extra_ms"]) if w.stream else 0.0
    saves = checkpoints_per_s(w)
    parts = {"requests": requests * k["request_us"],
             "stream_chunks": chunks * k["chunk_us"] + writes * k["chunk_call_us"],
             "checkpoints": saves * k["checkpoint_us"], "idle_workers": w.workers_per_gpu * k["idle_worker_us"]}
    budget = share_of_core * MILLION
    variable = parts["requests"] + parts["stream_chunks"] + parts["checkpoints"]
    fixed = parts["idle_workers"]
    by_shards = {s: budget / (variable / s + fixed) for s in shards if s >= 1}
    return Estimate(workload=w, constants=k, share_of_core=share_of_core, requests_per_s=requests,
                    tokens_per_chunk=per_chunk, chunks_per_s=chunks, chunk_writes_per_s=writes,
                    checkpoints_per_s=saves, per_gpu_us=parts,
                    gpus=budget / (variable + fixed), shards=by_shards)


def redis_share(w: Workload, gpus: float, **overrides: float | None) -> float:
    """The share of one core a primary spends on ``gpus`` GPUs of workload ``w`` (the model's
    prediction that ``benchmarks/capacity_check.py`` holds to a measurement)."""
    return gpus * estimate(replace(w), share_of_core=1.0, shards=(), **overrides).per_gpu_total_us / MILLION


def render(e: Estimate, gpus: int | None = None) -> str:
    """The derivation, as ``redroll capacity`` prints it."""
    w, k = e.workload, e.constants
    lines = [
        f"workload per GPU: {w.tokens_per_s:,.0f} tokens/s, {w.completion_tokens:,.0f}-token completions, "
        f"{w.concurrency} decoding at once, streaming {'on' if w.stream else 'off'}, "
        f"checkpoints {'on' if w.continuation and not w.stream else 'by chunk' if w.stream else 'off'}, {w.workers_per_gpu:g} worker(s)",
        "",
        f"requests/s      R = T / L = {w.tokens_per_s:,.0f} / {w.completion_tokens:,.0f} = {e.requests_per_s:,.2f}",
    ]
    if w.stream:
        per_stream = w.tokens_per_s / w.concurrency
        lines.append(f"tokens a chunk  k = min({w.stream_chunk_tokens}, max(1, {per_stream:,.1f} tokens/s x "
                     f"({w.stream_chunk_ms:g} + {k['chunk_timer_extra_ms']:g}) ms)) = {e.tokens_per_chunk:,.2f}")
        lines.append(f"chunks/s        K = T / k = {e.chunks_per_s:,.1f}")
        every = 1000.0 * w.workers_per_gpu / e.chunk_writes_per_s if e.chunk_writes_per_s else 0.0
        lines.append(f"chunk writes/s  C = w x 1000 / {every:,.1f} ms = {e.chunk_writes_per_s:,.1f} "
                     "(one a worker's look with chunks due)")
    if e.checkpoints_per_s:
        lines.append(f"checkpoints/s   P = {e.checkpoints_per_s:,.2f}")
    lines += [
        "",
        "Redis CPU per GPU (µs each second):",
        f"  requests      R x {k['request_us']:g} µs = {e.per_gpu_us['requests']:,.0f}",
        f"  chunks        K x {k['chunk_us']:g} µs + C x {k['chunk_call_us']:g} µs = "
        f"{e.per_gpu_us['stream_chunks']:,.0f}",
        f"  checkpoints   P x {k['checkpoint_us']:g} µs = {e.per_gpu_us['checkpoints']:,.0f}",
        f"  workers       w x {k['idle_worker_us']:g} µs = {e.per_gpu_us['idle_workers']:,.0f}",
        f"  total         U = {e.per_gpu_total_us:,.0f} µs/s ({100 * e.per_gpu_total_us / MILLION:.3f}% of a core)",
        "",
        f"one primary at {100 * e.share_of_core:g}% of its core carries N = {e.share_of_core:g} x 1,000,000 / U = "
        f"{e.gpus:,.0f} GPUs",
    ]
    if e.shards:
        lines.append("a Redis Cluster (partitions over S shards; heartbeats and control stay on one):")
        lines += [f"  S = {s}: {n:,.0f} GPUs" for s, n in e.shards.items()]
    if gpus is not None:
        need = next((s for s, n in e.shards.items() if n >= gpus), None)
        share = gpus * e.per_gpu_total_us / MILLION
        lines.append("")
        lines.append(f"{gpus:,} GPUs: one primary at {100 * share:.0f}% of a core; "
                     + (f"{need} shard(s) keep each under {100 * e.share_of_core:g}%" if need
                        else f"more than {max(e.shards)} shards"))
    return "\n".join(lines)
