"""Key names of one pipeline (see docs/design.md, "Keys").

Every key that one request touches carries the same hash tag, so Lua scripts and MULTI stay
inside one Redis Cluster slot.
"""

from __future__ import annotations

import functools
import hashlib
import time
import zlib
from dataclasses import dataclass
from typing import Any

WORKERS_GROUP = "workers"
"""Consumer group on the request stream."""

PRODUCER_GROUP = "producer"
"""Consumer group a producer uses on its private reply stream."""


def partition_keys(namespace: str, partitions: int, lanes: int = 0) -> list["Keys"]:
    """The per-request key sets of a pipeline: the plain ``{ns}`` layout for one partition,
    else P complete copies tagged ``{ns:0}`` … ``{ns:P-1}`` (each can live on its own cluster node)."""
    return list(partition_key_sets(namespace, partitions, lanes))


@functools.lru_cache(maxsize=256)
def partition_key_sets(namespace: str, partitions: int, lanes: int = 0) -> tuple["Keys", ...]:
    """:func:`partition_keys` as a tuple, built once per (namespace, partitions, lanes): producers
    look a request's partition up for every submit."""
    if partitions < 1:
        raise ValueError("partitions must be at least 1")
    if lanes < 0:
        raise ValueError("affinity_lanes must be 0 (off) or more")
    if partitions == 1:
        return (Keys(namespace, lanes=lanes),)
    return tuple(Keys(namespace, i, lanes=lanes) for i in range(partitions))


def partition_index(placement_key: str, partitions: int) -> int:
    """Stable placement (CRC-32) of a group_id or request_id among ``partitions``."""
    return zlib.crc32(placement_key.encode()) % partitions if partitions > 1 else 0


_LANE_SALT = b"redroll-lane:"


def lane_index(affinity_key: str, lanes: int) -> int:
    """The affinity lane of ``affinity_key`` among ``lanes``: a salted BLAKE2b hash, independent of
    the partition's CRC-32 (the same hash mod L would leave lanes empty whenever P and L share a
    factor), so every producer picks the same lane with no shared state."""
    digest = hashlib.blake2b(_LANE_SALT + affinity_key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % lanes


def _tag_of(key: str) -> str:
    return key[: key.index("}") + 1] if key.startswith("{") and "}" in key else key


def finish_marker_key(stream: str, consumer: str) -> str:
    """``Keys.finished(consumer)`` of the partition whose request stream is ``stream`` (its hash tag)."""
    return f"{_tag_of(stream)}:finished:{consumer}"


HANDBACKS_MAXLEN = 1000
"""About how many notes ``Keys.handbacks`` keeps (each is read at once by the workers alive)."""


def events_key(stream: str, request_id: str) -> str:
    """``Keys.events(request_id)`` of the partition that ``stream`` (any key of it) belongs to."""
    return f"{_tag_of(stream)}:events:{request_id}"


def parts_key_for(stream: str, worker: str) -> str:
    """``Keys.parts(worker)`` of the partition that ``stream`` (any key of it) belongs to."""
    return f"{_tag_of(stream)}:parts:{worker}"


def stream_name(stream: str) -> str:
    """A request stream's name after its hash tag (``{ns}:requests:high`` is ``requests:high``): how
    the rid key, the ownership hash and the event log name it."""
    return stream.split("}:", 1)[1] if stream.startswith("{") and "}:" in stream else stream


def submitted_as(stream: str, entry_id: str) -> str:
    """How the submit names an entry in its rid key (after the token) and in the ownership hash:
    the request stream's name after its hash tag, then the entry id (``requests:high 1700-0``).
    Entry ids are per stream: an entry forged on another request stream may carry the same id."""
    return f"{stream_name(stream)} {entry_id}"


def owner_key_for(reply_key: str) -> str | None:
    """The ownership hash (``Keys.owner``) of the producer whose reply stream is ``reply_key``
    (``{tag}:reply:<producer>``), else None (a results stream: no producer owns it)."""
    tag, sep, producer = reply_key.partition("}:reply:")
    if not sep or not tag.startswith("{") or not producer:
        return None
    return f"{tag}}}:own:{producer}"


def chunks_key_for(reply_key: str) -> str | None:
    """The chunk stream (``Keys.chunks``) of the streamed requests that reply to ``reply_key``
    (``{tag}:reply:<producer>``), else None (a results stream: no producer reads chunks there)."""
    tag, sep, producer = reply_key.partition("}:reply:")
    if not sep or not tag.startswith("{") or not producer:
        return None
    return f"{tag}}}:chunks:{producer}"


class TaggedKey:
    """A key of a pipeline named by a fixed suffix after its hash tag: ``Keys.results`` is
    ``TaggedKey("results")``, ``{ns}:results`` (worked out once per ``Keys``, then kept)."""

    def __init__(self, suffix: str):
        self.suffix = suffix
        self.name = suffix

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, keys: "Keys | None", owner: type | None = None) -> Any:
        if keys is None:
            return self
        value = keys.__dict__[self.name] = f"{keys.tag}:{self.suffix}"  # (kept: read from the instance next)
        return value


@dataclass(frozen=True)
class Keys:
    """All key names of a pipeline in namespace ``namespace``.

    ``partition`` is None for the plain single-partition layout (tag ``{ns}``).
    """

    namespace: str = "redroll"
    partition: int | None = None
    lanes: int = 0
    """Affinity lanes per partition (0: off, the plain layout)."""

    def __post_init__(self) -> None:
        if not self.namespace or any(c in self.namespace for c in "{}: \t\r\n"):
            raise ValueError(
                f"namespace {self.namespace!r} must be non-empty without braces, colons or whitespace"
            )

    @functools.cached_property
    def tag(self) -> str:
        if self.partition is None:
            return "{" + self.namespace + "}"
        return "{" + f"{self.namespace}:{self.partition}" + "}"

    requests = TaggedKey("requests")
    """Stream: the shared request stream (group ``workers``)."""
    requests_high = TaggedKey("requests:high")
    """High-priority requests: workers claim from here before ``requests``."""

    def lane(self, j: int) -> str:
        """Affinity lane ``j``: requests whose affinity key hashes to it (group ``workers``)."""
        return f"{self.tag}:requests:lane:{j}"

    @functools.cached_property
    def lane_streams(self) -> list[str]:
        return [self.lane(j) for j in range(self.lanes)]

    @property
    def request_streams(self) -> list[str]:
        """Request streams in claiming order (high priority first, then the lanes, then the shared one)."""
        return [self.requests_high, *self.lane_streams, self.requests]

    config = TaggedKey("config")
    """Hash: settings every process of the pipeline must agree on (``affinity_lanes``)."""
    results = TaggedKey("results")
    """Stream: the default reply stream (any number of consumer groups)."""
    dead = TaggedKey("dead")
    """Stream: dead letters (``reason``, ``source``, then the original fields)."""
    control = TaggedKey("control")
    """Stream: broadcast commands to every worker (read with plain XREAD)."""
    weights = TaggedKey("weights")
    """Hash: the fleet's desired weights and pause state, read by workers at start."""
    aborted = TaggedKey("aborted")
    """Sorted set: aborted ``r:<request_id>`` / ``g:<group_id>``, scored by time."""
    handbacks = TaggedKey("handbacks")
    """Stream: workers' notes that they handed entries back (a notice, a drain), so that idle
    workers take them at once; capped at about :data:`HANDBACKS_MAXLEN` entries."""
    workers = TaggedKey("workers")
    """Hash: worker heartbeats, name → JSON."""
    reclaim_marks = TaggedKey("reclaim_marks")
    """Sorted set: request stream -> ms part of the newest entry id a worker handed back there
    (``renew.lua``; the reclaim passes look that far: ``reclaim_scan.lua``)."""
    lane_members = TaggedKey("lanes:members")
    """Sorted set, with affinity lanes: the claiming workers, each scored with the server time
    (ms) of its last heartbeat (see ``shared/lua/lanes_beat.lua``)."""
    lane_plan = TaggedKey("lanes:plan")
    """String, with affinity lanes: the published list of claiming workers (one name a line)
    that every worker computes the lanes' owners from (its epoch: ``lane_epoch`` in :attr:`config`)."""
    lane_full = TaggedKey("lanes:full")
    """Set, with affinity lanes: the claiming workers whose last heartbeat said no free slot."""
    errors = TaggedKey("errors")
    """Hash: request entry id → last engine error, so the dead letter can say why."""

    def weight_sync(self, sync_id: str) -> str:
        """Hash: one trainer push's progress, ``<worker>:<attempt>`` → joined / received / committed /
        failed: …, written by the workers, read by the trainer; it expires."""
        return f"{self.tag}:wsync:{sync_id}"

    reply_prefix = TaggedKey("reply:")

    def reply(self, producer: str) -> str:
        return self.reply_prefix + producer

    def rid(self, request_id: str) -> str:
        return f"{self.tag}:rid:{request_id}"

    def owner(self, producer: str) -> str:
        """Hash: request_id → entry id of ``producer``'s live requests, written by its submit in the
        producer's own key space (an exact key name, which only its ACL user may write), checked by
        the worker's finish before it publishes to the producer's reply stream; the field goes with
        the finish."""
        return f"{self.tag}:own:{producer}"

    def finished(self, consumer: str) -> str:
        """List: the entries ``consumer`` (a worker) finished lately, so that a retry of a finish
        whose reply was lost is told from a lost lease (written by finish_many.lua; it expires:
        :data:`redroll.shared.scripts.FINISH_MARKER_TTL_MS`)."""
        return finish_marker_key(self.requests, consumer)

    def partial(self, request_id: str) -> str:
        """String: the checkpoint of a resumable request's partial output (see engine_worker/checkpoints.py)."""
        return f"{self.tag}:partial:{request_id}"

    def parts(self, worker: str) -> str:
        """Stream: one worker's checkpoint parts saved since each checkpoint's last consolidation,
        one entry per call (see engine_worker/checkpoint_writes.py); trimmed by age, expiring."""
        return f"{self.tag}:parts:{worker}"

    def session(self, name: str) -> str:
        """String: a gateway session's conversation as token ids (``redroll serve``'s token-exact
        sessions, see redroll/web/gateway/sessions.py); expires with the session's window."""
        return f"{self.tag}:session:{name}"

    def chunks(self, producer: str) -> str:
        """Stream: the chunks of ``producer``'s streamed requests (``stream``), each one part of a
        checkpoint (see engine_worker/settled_text.py): one entry per worker call, a field per chunk
        (see shared/chunks.py). Trimmed to the last ``stream_chunk_ttl_s`` and expiring that long
        after its last entry."""
        return f"{self.tag}:chunks:{producer}"

    def events(self, request_id: str) -> str:
        """Stream: the event log of one request (submitted, deliveries, checkpoints, the finish, dead
        letters, consumer groups that applied it), capped and expiring (see redroll/ops/trace.py)."""
        return f"{self.tag}:events:{request_id}"

    def applied(self, group: str, bucket: int) -> str:
        return f"{self.tag}:applied:{group}:{bucket}"

    def applied_buckets(self, group: str, window_s: float, now: float | None = None) -> list[str]:
        """The current and previous de-duplication bucket keys (together they cover the window)."""
        now = time.time() if now is None else now
        bucket = int(now // window_s)
        return [self.applied(group, bucket), self.applied(group, bucket - 1)]

    def is_reply_key(self, key: str) -> bool:
        """True when ``key`` is a stream this pipeline may write results to."""
        if key == self.results:
            return True
        if key.startswith(self.reply_prefix):
            name = key[len(self.reply_prefix):]
            return 0 < len(name) <= 128 and all(0x21 <= ord(c) <= 0x7E and c not in "{}" for c in name)
        return False
