"""Reading a checkpoint back: its key (``{tag}:partial:<request_id>``: a header and the parts of its
last consolidation) and the parts saved after that in its writer's parts stream
(``{tag}:parts:<worker>``; the writes: :mod:`redroll.engine_worker.checkpoint_writes`).

Only the lease owner writes a checkpoint's key, in consolidating saves: its first save of a
delivery (with the parts it read back, if any), then one every ``CONSOLIDATE_S`` while it has parts
the key lacks, and its flush before a hand-back. Every other save is one field of the worker's
parts stream, ``<entry id> <request_id> <tokens before it> <tokens in it>``, the part its value (a
consolidating save's field, with no value, marks where the key took over). Reading back: the key,
then its writer's parts stream newest first, down to a field of this entry that the key already
holds (what lies before it is older: earlier consolidations, an earlier delivery); the parts after
it are taken in order from the key's count on, as long as each starts where the one before ended
(a later part with the same start replaces an earlier one: a save sent again after its reply was
lost).

Why the parts of a request that is not streamed need no fence when written: a part is read only
from the stream of the key's writer, and only after that writer's own consolidation, so what is
read is one worker's run of one delivery, token after token. A worker that lost the lease and goes
on writing adds to its own run, which the worker that took over either read before its first save
(and made its own) or never reads. A streamed request's part is also a chunk its readers see at
once, so that one is fenced (``save_parts.lua``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from redroll.shared.chunks import Part, chunks_by_request, decode_part
from redroll.shared.keys import Keys

HEADER_BYTES = 64
"""``<entry id, space-padded to 44> <18-digit token count>\\n``."""
PARTS_READ_BATCH = 256
"""Entries of a parts stream read at a time, newest first."""


@dataclass
class Checkpoint:
    """What was saved for one entry."""

    entry_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    weight_versions: list[str] = field(default_factory=list)
    segments: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""
    """The text the parts carried (a streamed request's: what its readers were sent)."""
    top_logprobs: list[list[tuple[int, float]]] | None = field(default_factory=list)
    """Per token, the k most likely (token id, logprob) pairs (``top_logprobs_num``); None when a part had none."""
    size: int = HEADER_BYTES
    """The key's bytes (header and parts) as it was read."""
    kept: int = 0
    """Tokens the key holds (its header's count); the rest came from its writer's parts stream."""
    later: list[bytes] = field(default_factory=list)
    """The parts read from the parts stream (as saved), in order: a continuing writer's first save
    appends them to the key before its own."""

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    @property
    def writer(self) -> str | None:
        """The worker that wrote its last part (whose parts stream holds what came after)."""
        return self.segments[-1]["worker"] if self.segments else None

    def add(self, part: Part) -> None:
        """Append ``part``'s tokens and what comes with them."""
        self.token_ids += part.token_ids
        if self.logprobs is not None and part.logprobs is not None:
            self.logprobs += part.logprobs
        else:
            self.logprobs = None
        versions = part.versions()
        self.weight_versions += versions
        last = self.segments[-1] if self.segments else None
        version = versions[-1] if versions else None
        if last is not None and last["worker"] == part.worker and last["weight_version"] == version:
            last["tokens"] += len(part.token_ids)
        else:
            self.segments.append({"worker": part.worker, "weight_version": version, "tokens": len(part.token_ids)})
        self.finish_reason = part.finish_reason
        self.text += part.text or ""
        if self.top_logprobs is not None and part.top_logprobs is not None:
            self.top_logprobs += [[(int(t), float(lp)) for t, lp in pairs] for pairs in part.top_logprobs]
        else:
            self.top_logprobs = None


def parse_checkpoint(raw: bytes) -> Checkpoint | None:
    """The checkpoint key's value ``raw``; None when it is not one (a torn or foreign value)."""
    if len(raw) < HEADER_BYTES or raw[HEADER_BYTES - 1:HEADER_BYTES] != b"\n":
        return None
    entry_id = raw[:44].decode("ascii", "replace").strip()
    try:
        count = int(raw[45:63])
    except ValueError:
        return None
    cp = Checkpoint(entry_id=entry_id, size=len(raw))
    pos = HEADER_BYTES
    while pos < len(raw):
        try:
            size = int(raw[pos:pos + 8], 16)
            part = decode_part(raw[pos + 8:pos + 8 + size])
        except (ValueError, msgspec.DecodeError):
            return None
        pos += 8 + size
        cp.add(part)
    if cp.tokens != count:
        return None
    cp.kept = count
    return cp


async def read_later_parts(redis: Any, parts_key: str, entry_id: str, request_id: str,
                           kept: int) -> list[tuple[int, bytes]]:
    """The parts of ``request_id`` (of the entry ``entry_id``) in ``parts_key`` saved after the
    consolidation that left its checkpoint holding ``kept`` tokens, as (tokens before it, the
    part), oldest first."""
    name = f"{entry_id} {request_id}"  # (a part's field: '<entry id> <request_id> <before> <tokens>')
    found: list[tuple[int, bytes]] = []
    top = "+"
    while True:
        entries = await redis.xrevrange(parts_key, top, "-", count=PARTS_READ_BATCH)
        for entry_id, fields in entries:
            mine = chunks_by_request(fields).get(name, [])
            found += [(before, data) for before, data in reversed(mine) if before >= kept]
            if any(before < kept for before, _ in mine):
                return found[::-1]
        if len(entries) < PARTS_READ_BATCH:
            return found[::-1]
        last = entries[-1][0]
        top = "(" + (last.decode() if isinstance(last, bytes) else str(last))


def take_later_parts(cp: Checkpoint, parts: list[tuple[int, bytes]]) -> None:
    """Append to ``cp`` the parts that go on from its count, in order (see the module's doc)."""
    by_start: dict[int, bytes] = {}
    for before, data in parts:
        by_start[before] = data  # (a later one with the same start replaces it)
    while cp.tokens in by_start:
        data = by_start.pop(cp.tokens)
        try:
            part = decode_part(data[8:8 + int(data[:8], 16)])
        except (ValueError, msgspec.DecodeError):
            return
        if not part.token_ids:
            return
        cp.add(part)
        cp.later.append(data)


async def load_checkpoint(redis: Any, part: Keys, request_id: str, entry_id: str | None = None) -> Checkpoint | None:
    """The checkpoint of ``request_id`` (of the entry ``entry_id``, when given; else whatever entry
    it names) with the parts saved after its last consolidation; None when there is none."""
    raw = await redis.get(part.partial(request_id))
    if raw is None:
        return None
    cp = parse_checkpoint(raw)
    if cp is None or (entry_id is not None and cp.entry_id != entry_id):
        return None  # another entry's (a requeue, a resubmit) or not readable: start over
    if cp.writer is not None:
        take_later_parts(cp, await read_later_parts(redis, part.parts(cp.writer), cp.entry_id, request_id, cp.kept))
    return cp


__all__ = ["Checkpoint", "HEADER_BYTES", "load_checkpoint", "parse_checkpoint", "read_later_parts",
           "take_later_parts"]
