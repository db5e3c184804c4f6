"""Dead-letter tools: list, requeue (re-validated, optionally patched), purge."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any, Sequence

import msgspec
from redis.asyncio import Redis

from redroll.shared.codec import ValidationError, decode_record, decode_request
from redroll.shared.errors import RedrollError
from redroll.shared.keys import Keys
from redroll.shared.refusals import StreamRefusedError
from redroll.shared.scripts import DuplicateRequestError, Scripts
from redroll.shared.settings import Settings
from redroll.shared.streams import id_tuple, text
from redroll.shared.values import key_values

PLAIN = ("reason", "source", "entry", "deliveries", "reply_error")


@dataclass
class DeadEntry:
    id: str
    reason: str
    source: str
    request_id: str | None
    deliveries: int
    age_s: float
    original: dict[bytes, bytes]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "reason": self.reason, "source": self.source, "request_id": self.request_id,
                "deliveries": self.deliveries, "age_s": round(self.age_s, 1)}


def _parse(entry_id: Any, fields: dict[bytes, bytes]) -> DeadEntry:
    eid = text(entry_id)
    original = {k: v for k, v in fields.items() if text(k) not in PLAIN}
    rid = original.get(b"rid")
    try:
        deliveries = int(fields.get(b"deliveries", b"0"))
    except ValueError:
        deliveries = 0
    return DeadEntry(
        id=eid,
        reason=text(fields.get(b"reason", b"")),
        source=text(fields.get(b"source", b"")),
        request_id=text(rid) if rid is not None else None,
        deliveries=deliveries,
        age_s=time.time() - id_tuple(eid)[0] / 1000.0,
        original=original,
    )


async def list_dead(r: Redis, keys: Keys, *, reason: str | None = None, count: int = 1000) -> list[DeadEntry]:
    """Dead letters, oldest first; ``reason`` keeps those whose reason contains it."""
    entries = [_parse(i, f) for i, f in await r.xrange(keys.dead, count=count)]
    if reason:
        entries = [e for e in entries if reason.lower() in e.reason.lower()]
    return entries


class RequeueRefused(RedrollError, ValueError):
    """The entry is still invalid (or its request_id is live again); the message says why."""


def _patch(obj: dict, path: str, value: Any) -> None:
    parts = path.split(".")
    node = obj
    for part in parts[:-1]:
        nxt = node.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            node[part] = nxt
        node = nxt
    node[parts[-1]] = value


def patched_request_fields(entry: DeadEntry, patches: dict[str, Any], settings: Settings,
                           keys: Keys | None = None) -> tuple[str, dict]:
    """Validate (after patches) a dead request; returns (request_id, fields to XADD)."""
    data = entry.original.get(b"data")
    if patches:
        try:
            obj = msgspec.msgpack.decode(data) if data is not None else {}
        except Exception:
            raise RequeueRefused(f"{entry.id}: payload is not msgpack, cannot patch it") from None
        if not isinstance(obj, dict):
            raise RequeueRefused(f"{entry.id}: payload is not a map, cannot patch it")
        for path, value in patches.items():
            _patch(obj, path, value)
        data = msgspec.msgpack.encode(obj)
    fields = dict(entry.original)
    fields[b"data"] = data
    try:
        req = decode_request(fields, settings.limits)
    except ValidationError as exc:
        raise RequeueRefused(f"{entry.id}: still invalid: {exc.reason}") from None
    keys = keys or settings.keys
    if req.reply_to is not None and not keys.is_reply_key(req.reply_to):
        raise RequeueRefused(f"{entry.id}: still invalid: reply_to {req.reply_to!r} is not a stream of this pipeline")
    req.submitted_at = time.time()
    req.requeued += 1  # a new attempt: consumer groups that applied its error record apply this one
    out = {b"rid": req.request_id.encode()}
    if req.reply_to:
        out[b"reply_to"] = req.reply_to.encode()
    out[b"data"] = msgspec.msgpack.encode(req)
    return req.request_id, out


async def requeue(r: Redis, settings: Settings, ids: Sequence[str] | None, *,
                  patches: dict[str, Any] | None = None) -> tuple[list[str], list[str]]:
    """Requeue dead letters by id (None = all). Returns (requeued ids, refusal messages).

    Requests go back to ``{ns}:requests`` through the de-duplicating submit script; records
    dead-lettered by a consumer go back to the stream they came from. Each is re-validated first.
    """
    scripts = Scripts(r)
    wanted = None if ids is None else set(ids)
    done: list[str] = []
    refused: list[str] = []
    for keys in settings.partition_keys:
        await _requeue_partition(r, settings, keys, scripts, wanted, patches or {}, done, refused)
    if wanted is not None:
        refused += [f"{i}: no such dead letter" for i in sorted(wanted - set(done)) if
                    not any(m.startswith(f"{i}:") for m in refused)]
    return done, refused


async def _requeue_partition(r: Redis, settings: Settings, keys: Keys, scripts: Scripts, wanted: set[str] | None,
                             patches: dict[str, Any], done: list[str], refused: list[str]) -> None:
    for entry in await list_dead(r, keys, count=100_000):
        if wanted is not None and entry.id not in wanted:
            continue
        try:
            if entry.source.startswith("consumer:"):
                await _requeue_record(r, keys, entry)
            else:
                request_id, fields = patched_request_fields(entry, patches, settings, keys)
                try:
                    await scripts.submit(keys.requests, keys.rid(request_id), f"requeue:{secrets.token_hex(8)}",
                                         request_id, text(fields[b"reply_to"]) if b"reply_to" in fields else None,
                                         fields[b"data"], settings.rid_ttl_s)
                except (DuplicateRequestError, StreamRefusedError) as exc:
                    raise RequeueRefused(f"{entry.id}: {exc}") from None
        except RequeueRefused as exc:
            refused.append(str(exc))
            continue
        await r.xdel(keys.dead, entry.id)
        done.append(entry.id)


async def _requeue_record(r: Redis, keys: Keys, entry: DeadEntry) -> None:
    try:
        decode_record(entry.original)
    except ValidationError as exc:
        raise RequeueRefused(f"{entry.id}: still invalid: {exc.reason}") from None
    await r.xadd(keys.results, entry.original)


async def purge(r: Redis, keys: Keys, ids: Sequence[str] | None = None, *, older_than_s: float | None = None) -> int:
    """Delete dead letters: the given ids, those older than ``older_than_s``, or (neither) all."""
    if ids:
        return int(await r.xdel(keys.dead, *ids))
    if older_than_s is not None:
        cutoff_ms = int((time.time() - older_than_s) * 1000)
        return int(await r.xtrim(keys.dead, minid=f"{cutoff_ms}-0", approximate=False))
    n = int(await r.xlen(keys.dead))
    await r.delete(keys.dead)
    return n


def parse_patches(pairs: Sequence[str]) -> dict[str, Any]:
    """``["sampling_params.temperature=0.7"]`` → ``{"sampling_params.temperature": 0.7}`` (JSON values)."""
    return key_values(pairs, "--set", "FIELD.PATH=JSON")
