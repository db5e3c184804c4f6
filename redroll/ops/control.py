"""Broadcasting control commands (abort, drain, weights, memory) and cancelling queued requests.

The commands themselves are the tagged union of :mod:`.commands`."""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from redis.asyncio import Redis

from redroll.shared.codec import ValidationError, check_request_id, decode_request
from redroll.shared.commands import (
    Abort,
    Command,
    CommandFailed,
    Pause,
    PauseMode,
    Resume,
    UpdateMode,
    UpdateWeights,
    command_fields,
    parse_command,
)
from redroll.shared.keys import WORKERS_GROUP, Keys, owner_key_for
from redroll.shared.types import CompletionRecord, RecordStatus

log = logging.getLogger("redroll")

CONTROL_MAXLEN = 10_000
ABORTED_RETENTION_S = 24 * 3600


def aborted_member(request_id: str | None = None, group_id: str | None = None) -> str:
    return f"g:{group_id}" if group_id is not None else f"r:{request_id}"


async def send_abort(r: Redis, keys: Keys, request_ids: Sequence[str] = (), group_ids: Sequence[str] = ()) -> None:
    """Mark ids aborted (so queued entries are skipped) and tell live workers (so in-flight ones stop)."""
    for rid in request_ids:
        check_request_id(rid)
    for gid in group_ids:
        check_request_id(gid, "group_id")
    now = time.time()
    members = {aborted_member(request_id=x): now for x in request_ids}
    members.update({aborted_member(group_id=g): now for g in group_ids})
    if not members:
        return
    async with r.pipeline(transaction=True) as pipe:
        pipe.zadd(keys.aborted, members)
        pipe.zremrangebyscore(keys.aborted, "-inf", now - ABORTED_RETENTION_S)
        pipe.xadd(keys.control, command_fields(Abort(request_ids=list(request_ids), group_ids=list(group_ids))),
                  maxlen=CONTROL_MAXLEN, approximate=True)
        await pipe.execute()


async def cancel_queued(r: Redis, keys: Keys, request_ids: Sequence[str],
                        parts: Sequence[Keys] | None = None) -> list[str]:
    """Report aborted requests that no worker has taken yet at once (their record is published
    here to the producer's reply stream and the entry deleted), instead of when a worker reaches
    them in the backlog.

    The request_id's rid key stays until housekeeping releases it (``redroll gc``, and the
    workers' about once per ``gc_interval_s``): a producer may not delete rid keys, so until then
    a submit of the same request_id is refused as a duplicate.

    Returns the request_ids cancelled this way; the others are in flight (the worker aborts them),
    already finished, fire-and-forget (no producer writes a results stream: the worker that takes
    one publishes its aborted record), or their reply stream refused the record (the worker that
    takes them deals with that).

    Such a record has no engine facts (prompt_tokens, cached_tokens, engine_ms, eos/pad ids):
    no engine saw the request. It carries the pipeline's desired ``weight_version`` (the version
    it would have run on), ``worker`` None, ``attempt`` 0 and ``queue_ms``.
    """
    from redroll.shared.scripts import Scripts

    scripts = Scripts(r)
    parts = list(parts or [keys])
    # A request lives in one partition; look for its rid key in each (one MGET per partition).
    located: list[tuple[str, Keys, bytes]] = []
    for part in parts:
        held = await r.mget([part.rid(x) for x in request_ids]) if request_ids else []
        located += [(rid, part, value) for rid, value in zip(request_ids, held) if value is not None]
    if not located:
        return []
    desired = await r.hget(keys.weights, "weight_version")
    weight_version = desired.decode() if isinstance(desired, bytes) else desired
    cancelled: list[str] = []
    for request_id, keys_, value in located:
        entry_id = value.decode().rpartition(" ")[2]
        for stream in keys_.request_streams:
            found = await r.xrange(stream, entry_id, entry_id)
            if not found:
                continue
            try:
                req = decode_request(found[0][1])
            except ValidationError:
                break  # a worker will dead-letter it
            reply = req.reply_to if req.reply_to and keys_.is_reply_key(req.reply_to) else keys_.results
            owner = owner_key_for(reply)
            if owner is None:
                break  # (no producer writes a results stream: the worker that meets it publishes its record)
            queue_ms = max(0.0, (time.time() - req.submitted_at) * 1000.0)
            record = CompletionRecord.failed(req, request_id=req.request_id, status=RecordStatus.ABORTED, error=None,
                                             worker=None, n=req.n,
                                             meta_info={"abort_reason": "user", "cancelled_in_queue": True,
                                                        "weight_version": weight_version, "worker": None,
                                                        "attempt": 0, "queue_ms": round(queue_ms, 3)})
            done = await scripts.cancel_queued_in(r, stream=stream, reply_key=reply, group=WORKERS_GROUP,
                                                  entry_id=entry_id, record=record)
            if isinstance(done, bytes):
                log.warning("request %s stays queued: %s refused its aborted record (%s); the worker that "
                            "takes it aborts it", request_id, reply, done.decode(errors="replace"))
            elif int(done):
                cancelled.append(request_id)
                await r.hdel(owner, request_id)  # (its own ownership hash: the submit wrote it there)
            break
    return cancelled


async def abort_requests(r: Redis, keys: Keys, request_ids: Sequence[str] = (), *,
                         group_ids: Sequence[str] = (), known_members: Sequence[str] = (),
                         parts: Sequence[Keys] | None = None, what: str = "abort") -> list[str]:
    """Abort by request_id and/or group_id: the queued ones first, each cancelled in the queue at
    once (atomically: its aborted record published, its entry deleted, unless a worker took it
    meanwhile); then the rest is aborted in flight by its worker. In that order: an in-flight abort
    frees slots, and the workers would claim (and abort) the queued ones next. ``known_members``:
    request_ids of the groups that the caller knows (queued members can only be found by id).
    Passing refusals (out of memory, ...) are retried. Returns the request_ids cancelled in the queue."""
    from redroll.shared.refusals import retry_refused

    ids = list(dict.fromkeys(request_ids))
    candidates = ids + [x for x in known_members if x not in ids]
    cancelled = await retry_refused(lambda: cancel_queued(r, keys, candidates, parts=parts), what)
    rest = [x for x in ids if x not in set(cancelled)]
    if rest or group_ids:
        await retry_refused(lambda: send_abort(r, keys, rest, list(group_ids)), what)
    return cancelled


async def send_command(r: Redis, keys: Keys, command: Command) -> str:
    entry = await r.xadd(keys.control, command_fields(command), maxlen=CONTROL_MAXLEN, approximate=True)
    return entry.decode() if isinstance(entry, bytes) else entry


async def live_workers(r: Redis, keys: Keys, stale_after_s: float = 10.0) -> dict[str, dict[str, Any]]:
    """Heartbeats of workers seen within ``stale_after_s``: name → heartbeat."""
    import json

    now = time.time()
    out: dict[str, dict[str, Any]] = {}
    for name, raw in (await r.hgetall(keys.workers)).items():
        try:
            beat = json.loads(raw)
        except ValueError:
            continue
        if now - float(beat.get("seen", 0)) <= stale_after_s:
            out[name.decode() if isinstance(name, bytes) else name] = beat
    return out


async def update_weights(r: Redis, keys: Keys, model_path: str, weight_version: str, *,
                         abort_inflight: bool = False, mode: UpdateMode | None = None, wait: bool = True,
                         timeout: float = 600.0, stale_after_s: float = 10.0) -> dict[str, dict[str, Any]]:
    """Set the desired weights (``{ns}:weights``, read by workers that join later), broadcast the
    update, and (``wait``) return once every live worker reports ``weight_version``. ``mode``:
    ``quiesce`` (the default: in-flight requests finish first), ``abort`` (the same as
    ``abort_inflight``) or ``in_place`` (swapped while they run; engines that cannot quiesce).

    Raises TimeoutError naming the workers still behind.
    """
    async with r.pipeline(transaction=True) as pipe:
        pipe.hset(keys.weights, mapping={"model_path": model_path, "weight_version": weight_version,
                                         "updated_at": str(time.time())})
        pipe.xadd(keys.control, command_fields(UpdateWeights(
            model_path=model_path, weight_version=weight_version, abort_inflight=abort_inflight, mode=mode)),
            maxlen=CONTROL_MAXLEN, approximate=True)
        await pipe.execute()
    if not wait:
        return {}
    import asyncio

    deadline = time.monotonic() + timeout
    while True:
        workers = await live_workers(r, keys, stale_after_s)
        behind = {n: b for n, b in workers.items() if b.get("weight_version") != weight_version}
        if not behind:
            return workers
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers still behind weight_version {weight_version!r}: {', '.join(sorted(behind))}")
        await asyncio.sleep(0.1)


async def wait_for_memory_command(r: Redis, keys: Keys, kind: str, sent_id: str, want_state: str, *,
                                  timeout: float = 60.0, stale_after_s: float = 10.0
                                  ) -> tuple[list[str], dict[str, str]]:
    """After broadcasting a memory command (entry ``sent_id``): wait until every live worker is in
    ``want_state`` or reported ``command_failed`` for ``kind``. Returns (workers done, worker →
    error); on timeout, what is known by then."""
    done, failed, _behind = await wait_for_workers(r, keys, kind, sent_id, lambda beat: beat.get("state") == want_state,
                                                   timeout=timeout, stale_after_s=stale_after_s)
    return done, failed


async def pause_fleet(r: Redis, keys: Keys, mode: PauseMode = "keep") -> str:
    """Pause the fleet: every worker stops claiming (``mode``: what becomes of what runs, see
    :data:`~redroll.shared.commands.PauseMode`), and so does a worker that starts before the resume
    (``{ns}:weights`` field ``paused`` says ``<mode> <unix time>``). Returns the command's entry id."""
    async with r.pipeline(transaction=True) as pipe:
        pipe.hset(keys.weights, "paused", f"{mode} {time.time():.3f}")
        pipe.xadd(keys.control, command_fields(Pause(mode=mode)), maxlen=CONTROL_MAXLEN, approximate=True)
        _, entry = await pipe.execute()
    return entry.decode() if isinstance(entry, bytes) else entry


async def resume_fleet(r: Redis, keys: Keys) -> str:
    """Resume a paused fleet (the field ``paused`` emptied: producers may write, not delete, it)."""
    async with r.pipeline(transaction=True) as pipe:
        pipe.hset(keys.weights, "paused", "")
        pipe.xadd(keys.control, command_fields(Resume()), maxlen=CONTROL_MAXLEN, approximate=True)
        _, entry = await pipe.execute()
    return entry.decode() if isinstance(entry, bytes) else entry


async def fleet_paused(r: Redis, keys: Keys) -> str | None:
    """The paused fleet's mode, or None when it is not paused."""
    raw = await r.hget(keys.weights, "paused")
    value = (raw.decode() if isinstance(raw, bytes) else raw) or ""
    return value.split(" ", 1)[0] or None


async def wait_for_workers(r: Redis, keys: Keys, kind: str, sent_id: str, ready: Any, *, timeout: float = 60.0,
                           stale_after_s: float = 10.0) -> tuple[list[str], dict[str, str], list[str]]:
    """After broadcasting a command of ``kind`` (entry ``sent_id``): wait until every live worker
    is ``ready(heartbeat)`` or reported ``command_failed`` for ``kind``. Returns (workers ready,
    worker → error, workers still not ready when ``timeout`` ran out)."""
    import asyncio

    failed: dict[str, str] = {}
    position = sent_id
    deadline = time.monotonic() + timeout
    while True:
        for _stream, entries in await r.xread({keys.control: position}, count=100) or []:
            for entry_id, fields in entries:
                position = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                cmd = parse_command(fields)
                if isinstance(cmd, CommandFailed) and cmd.command == kind:
                    failed[cmd.worker] = cmd.error
        workers = await live_workers(r, keys, stale_after_s)
        done = sorted(n for n, b in workers.items() if ready(b) and n not in failed)
        behind = sorted(set(workers) - set(done) - set(failed))
        if not behind or time.monotonic() > deadline:
            return done, failed, behind
        await asyncio.sleep(0.05)
