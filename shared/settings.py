"""Settings shared by every process: defaults, ``REDROLL_*`` environment variables, flags."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

from redroll.shared.codec import Limits
from redroll.shared.keys import Keys, partition_index, partition_key_sets, partition_keys
from redroll.shared.types import GenerationRequest

ENV_PREFIX = "REDROLL_"
RECOVERY_SPLITS = ("halving", "alone")
"""The values of ``Settings.recovery_split``."""
EVENT_LOG_MODES = ("off", "incidents", "all")
"""The values of ``Settings.event_log``."""


@dataclass(frozen=True)
class Settings:
    """Everything a process needs to join a pipeline. Each field ``x`` reads ``REDROLL_X``."""

    redis_url: str = "redis://localhost:6379/0"
    namespace: str = "redroll"
    redis_username: str | None = None
    redis_password: str | None = None
    redis_password_file: str | None = None
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    redis_cluster: bool = False
    """Talk to a Redis Cluster (``redis_url`` is any node: the client discovers the rest)."""
    sentinel_username: str | None = None
    """With a ``redis+sentinel://`` URL: the ACL user the sentinels want (the Redis credentials
    above are for the primary)."""
    sentinel_password: str | None = None
    sentinel_password_file: str | None = None
    wait_replicas: int = 0
    """N > 0: a submit, a worker's finish and a consumer's ack are acknowledged only once N replicas
    have them (``WAIT N wait_timeout_ms`` after the write, on its connection); fewer in time is an
    error that the write's retry path takes (see docs/cluster.md). 0: no wait (asynchronous replication)."""
    wait_timeout_ms: int = 1000
    """How long one WAIT (or WAITAOF) waits for the replicas before the write counts as not durable."""
    wait_aof: bool = False
    """Wait with ``WAITAOF 1 wait_replicas wait_timeout_ms`` instead: the write is fsynced to the
    primary's append-only file and to ``wait_replicas`` replicas' (Redis 7.2+, Valkey 8; needs
    ``appendonly yes``). A server without WAITAOF is refused at start."""

    claim_idle_ms: int = 30_000
    """Entries idle longer than this in a dead process's pending list are reclaimed."""
    max_deliveries: int = 5
    """An entry delivered more often than this is dead-lettered."""
    claim_prefetch: int = 2
    """A worker claims what its engine can start now plus this many (so that a slot freed by a
    finish is refilled without waiting for a claim's round trip): it holds at most the engine's
    capacity (the synthetic engine's ``slots``, SGLang's ``max_running_requests``, vLLM's
    ``max_num_seqs``, the transformers engine's ``max_batch_size``) plus ``claim_prefetch``
    entries, and never more than ``max_inflight``. A burst thus spreads over idle workers instead of
    queueing in the engine of the first to wake; under steady load the engine stays full. 2 covers
    the round trip of a claim on a local network (a finish frees one slot at a time; when many
    finish at once, the claim loop refills the rest within a round trip or two). With an engine
    that does not say its capacity the bound is ``max_inflight``, as before; a prefetch as large as
    ``max_inflight`` restores the old behaviour (claim up to ``max_inflight`` at once). With
    affinity lanes the bound applies to what a worker takes from its own lanes too: the rest of a
    hot lane waits in the lane, where other workers steal it (``steal_after_ms``)."""
    recovery_split: str = "halving"
    """How survivors take back the in-flight entries of a worker that died (one of them may be
    what killed it: a "poison" request that kills every worker running it).

    ``"halving"`` (default): group testing. The entries that were together on the dead worker
    are taken back in bulk and run beside the survivors' other work, in groups at most half the
    size of the group each of them was in when it died (a note per entry, beside its delivery
    count, in ``{ns}:errors``): a poison entry is alone after about log2 N deaths, the halves
    without it finish, and a dead worker's batch costs about one generation after
    ``claim_idle``. A worker claims nothing new only while it runs an entry that is down to
    running alone. The deaths an entry witnessed in a group do not raise its delivery count; an
    entry is dead-lettered only when its worker died while it ran alone and it has witnessed
    ``max_deliveries`` deaths (or been delivered more often than that): a poison request's
    innocent neighbours are never dead-lettered with it. The cost: a poison request kills about
    max(``max_deliveries``, log2 N + 1) workers (N: the entries on the first worker it killed),
    each death re-running the in-flight work of that worker (so its neighbours may run several
    times before they finish, and a resumable one keeps its checkpoint: a checkpoint that
    advanced after a death clears the entry of suspicion).

    ``"alone"``: the old behaviour. Every suspect is taken one at a time and run with nothing
    else in flight (claiming stopped meanwhile): a poison request kills ``max_deliveries``
    workers and costs nobody else a re-run, but a dead worker's N entries take N generations one
    after the other."""
    heartbeat_s: float = 2.0
    drain_timeout_s: float = 30.0
    """A consumer's drain on SIGTERM; a worker's is ``notice_s`` (when this is smaller, this)."""
    notice_s: float = 25.0
    """A worker told to stop (SIGTERM, ``redroll drain``) has this long (docs/spot.md): what will
    finish within it finishes there, the rest is saved and handed back to the fleet at once, and
    what still runs when it is nearly over is handed back then. It fits Kubernetes' default grace
    period (30 s) with 5 s to spare for the save; set it a few seconds below the notice your
    platform gives (a spot VM's 30 s to 2 minutes)."""

    max_payload_bytes: int = 4 * 1024 * 1024
    max_new_tokens: int = 32768
    max_n: int = 64

    partitions: int = 1
    """P > 1 spreads the per-request keys over P hash tags ``{ns:i}`` (see docs/design.md)."""
    dedup_window_s: int = 3600
    """How long a consumer group remembers which request_ids it applied."""
    results_max_len: int = 1_000_000
    """Safety cap on the results stream when no consumer group trims it."""
    reply_ttl_s: int = 86_400
    """Reply streams of producers that never come back expire after this long idle."""
    gc_interval_s: float = 300.0
    """Workers run housekeeping (see ``redroll gc``) this often."""
    rid_ttl_s: int = 7 * 86_400
    """The expiry of a producer's ownership hash (renewed by each submit) and of checkpoints. Submit
    de-duplication keys (rid keys) have none: a producer may not set one on an existing key (it could
    shorten another producer's), so the finish, a dead letter or housekeeping deletes them."""
    continuation: bool = True
    """A request handed back (a drain, a notice) or taken from a dead worker continues from its
    saved tokens instead of starting over, wherever that samples from the distribution it would
    have had: single-sample requests (text and chat prompts included, on an engine with a
    tokenizer) without a grammar, a regex stop, a frequency or presence penalty, custom logit
    processor parameters, prompt logprobs or routed experts (those start over; a streamed or
    ``resumable`` request always continues). Off: only streamed and ``resumable`` requests do."""
    checkpoint_tokens: int = 32
    """Requests that continue (see ``continuation``): save partial output every this many new tokens ..."""
    checkpoint_interval_s: float = 2.0
    """... and at least this many seconds apart, whichever comes later (one write a worker tick
    for all its requests), so a SIGKILL loses at most about this much of a request's generation."""
    checkpoint_min_new_tokens: int = 0
    """Requests with a smaller max_new_tokens are saved only when a drain or a notice hands them
    back, never while they run."""
    stream_chunk_tokens: int = 8
    """Streamed requests (``stream``): send a chunk every this many new tokens ..."""
    stream_chunk_ms: float = 50.0
    """... or every this many milliseconds with at least one new token, whichever comes first (each
    chunk also checkpoints the request; a worker writes all its chunks and checkpoints of one tick
    in one call, and its streams' timers beat together, so that the chunks they send on the timer
    go in one write)."""
    stream_chunk_ttl_s: int = 600
    """A streamed request's chunk stream expires this long after its last chunk (between 0.9 and 1
    times it: its worker sets the TTL again every tenth of it; readers that come later, a gateway's
    retry say, take the whole output from the record)."""
    affinity_lanes: int = 0
    """L > 0: requests with an affinity key (a session id; a group's ``group_id``) queue on one
    of L lane streams per partition, each owned by one worker (prefix-cache reuse); 0: off."""
    steal_after_ms: int = 1000
    """With affinity lanes: an entry that waited this long in a lane is taken by any worker."""
    event_log: str = "incidents"
    """The per-request event log ``redroll trace`` reads (``{ns}:events:<request_id>``):
    ``"incidents"`` (default): requests that had one (an entry taken back from a dead or draining
    worker, a checkpoint, a lost lease, a dead letter) keep a log, their finish included; ``"all"``:
    every request's finish is logged too (one more key per request: see docs/operations.md for its
    cost); ``"off"``."""
    event_log_ttl_s: int = 3600
    """A request's event log expires this long after its last event."""
    event_log_max_bytes: int = 4096
    """The most a request's log holds (about 20 events; the oldest give way, and ``redroll trace``
    says how many did)."""
    models: str = ""
    """Several models, one pipeline each: ``name=namespace`` pairs, comma-separated
    (``policy=rl,judge=rl-judge``; a name alone is a namespace of that name). The first is the
    policy. Read by ``redroll serve`` and :class:`redroll.ModelRouter`; empty: one pipeline,
    ``namespace``."""

    def __post_init__(self) -> None:
        if self.recovery_split not in RECOVERY_SPLITS:
            raise ValueError(f"recovery_split ({ENV_PREFIX}RECOVERY_SPLIT) must be one of "
                             f"{', '.join(RECOVERY_SPLITS)}, got {self.recovery_split!r}")
        if (self.wait_replicas or self.wait_aof) and self.redis_cluster:
            raise ValueError(f"wait_replicas / wait_aof ({ENV_PREFIX}WAIT_REPLICAS, {ENV_PREFIX}WAIT_AOF) "
                             "work on one primary (with Sentinel or not), not with redis_cluster")
        if self.event_log not in EVENT_LOG_MODES:
            raise ValueError(f"event_log ({ENV_PREFIX}EVENT_LOG) must be one of {', '.join(EVENT_LOG_MODES)}, "
                             f"got {self.event_log!r}")
        _ = self.model_namespaces  # (a name given twice is refused here, at start)
        for name, least in _LEAST.items():
            value = getattr(self, name)
            if not value >= least:  # (NaN too)
                raise ValueError(f"{name} ({ENV_PREFIX}{name.upper()}) must be at least {least}, got {value!r}")

    @property
    def model_namespaces(self) -> dict[str, str]:
        """``models`` as model name → namespace, in order (empty when not set)."""
        out: dict[str, str] = {}
        for item in self.models.split(","):
            name, _, namespace = item.strip().partition("=")
            name, namespace = name.strip(), namespace.strip() or name.strip()
            if not name:
                continue
            if name in out:
                raise ValueError(f"models ({ENV_PREFIX}MODELS) names {name!r} twice")
            out[name] = namespace
        return out

    @property
    def keys(self) -> Keys:
        return partition_key_sets(self.namespace, 1, self.affinity_lanes)[0]

    @property
    def partition_keys(self) -> list[Keys]:
        """The per-request key sets: ``[Keys(ns)]`` for one partition, else one per ``{ns:i}``."""
        return partition_keys(self.namespace, self.partitions, self.affinity_lanes)

    def keys_for(self, request: GenerationRequest) -> Keys:
        """The partition a request lives in: by group_id (all samples of a prompt together, for
        prefix-cache reuse), else by request_id; with affinity lanes, by the affinity key first
        (a session's turns stay in one partition, so on one lane)."""
        parts = partition_key_sets(self.namespace, self.partitions, self.affinity_lanes)
        if self.affinity_lanes:
            key = request.affinity_key or request.group_id or request.request_id
        else:
            key = request.group_id or request.request_id
        return parts[partition_index(key, len(parts))]

    @property
    def limits(self) -> Limits:
        return _limits(self.max_payload_bytes, self.max_new_tokens, self.max_n)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "Settings":
        """Defaults, then ``REDROLL_*`` variables, then explicit overrides (flags) that are not None."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is None or raw == "":
                continue
            values[f.name] = _convert(f.name, f.type, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def with_(self, **changes: Any) -> "Settings":
        return replace(self, **changes)


_LEAST: dict[str, float] = {
    "claim_idle_ms": 1, "max_deliveries": 1, "claim_prefetch": 0, "heartbeat_s": 0.001, "drain_timeout_s": 0, "notice_s": 0,
    "max_payload_bytes": 1, "max_new_tokens": 1, "max_n": 1, "partitions": 1, "dedup_window_s": 1,
    "reply_ttl_s": 1, "gc_interval_s": 0.001, "rid_ttl_s": 1, "checkpoint_tokens": 1, "checkpoint_interval_s": 0,
    "checkpoint_min_new_tokens": 0, "affinity_lanes": 0, "steal_after_ms": 0, "wait_replicas": 0,
    "wait_timeout_ms": 1, "event_log_ttl_s": 1, "event_log_max_bytes": 256, "stream_chunk_tokens": 1,
    "stream_chunk_ms": 1, "stream_chunk_ttl_s": 1,
}
"""The smallest value each numeric setting takes (Redis refuses an expiry of 0 or less, a window
of 0 divides by zero, ...). ``results_max_len`` has none: 0 or less means no cap."""


@functools.lru_cache(maxsize=64)
def _limits(max_payload_bytes: int, max_new_tokens: int, max_n: int) -> Limits:
    """One (frozen) Limits per distinct setting: decoding reads it for every request."""
    return Limits(max_payload_bytes=max_payload_bytes, max_new_tokens=max_new_tokens, max_n=max_n)


def _convert(name: str, type_: Any, raw: str) -> Any:
    t = str(type_)
    if t.startswith("bool"):
        if raw.strip().lower() in ("1", "true", "yes", "on"):
            return True
        if raw.strip().lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a boolean (use 1/0, true/false, yes/no)")
    try:
        if t.startswith("int"):
            return int(raw)
        if t.startswith("float"):
            return float(raw)
    except ValueError:
        raise ValueError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a valid {t.split()[0]}") from None
    return raw
