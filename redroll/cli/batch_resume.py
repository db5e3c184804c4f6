"""Taking over an interrupted ``redroll submit FILE --wait --out OUT``.

A run that writes to OUT keeps a run file beside it, ``OUT.run``, naming its producer: its
requests' records go to that producer's reply streams, and its submit tokens are made from that
name and each request_id. ``--resume`` reads which records OUT already holds, writes the records
that reached the reply streams while nothing read them, and carries on as that producer: a
request still queued or in flight is submitted again with its own token, which takes it over
(no second entry, no second generation); only the requests the interrupted run never submitted
are new. The run file is removed once every record is in OUT, and it is locked while a run writes
OUT, so two runs never write one file.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from typing import IO

import msgspec
from redis.asyncio import Redis

from redroll.shared.codec import ValidationError, decode_record
from redroll.shared.errors import RedrollError
from redroll.shared.keys import PRODUCER_GROUP
from redroll.shared.streams import text
from redroll.shared.types import RecordStatus

RUN_SUFFIX = ".run"
FINISHED = RecordStatus.FINISHED.value


class ResumeError(RedrollError, ValueError):
    """OUT or its run file cannot be used as asked (the message says why and what to do)."""


class RunFile:
    """``OUT.run``, locked (``flock``) for as long as this run writes OUT."""

    def __init__(self, path: str, fh: IO[str], producer: str | None):
        self.path = path
        self._fh = fh
        self.producer = producer
        """The producer of the interrupted run that this one resumes (None: a new run)."""
        self._saved = producer is not None

    @classmethod
    def open(cls, out: str, namespace: str, *, resume: bool) -> "RunFile":
        path = out + RUN_SUFFIX
        fh = open(path, "a+", encoding="utf-8")  # (created when missing, never truncated here)
        try:
            producer = _locked_run(fh, out, path, namespace, resume=resume)
        except BaseException:
            fh.close()
            raise
        return cls(path, fh, producer)

    def save(self, producer: str, namespace: str) -> None:
        """Name this run's producer, durably, before anything is submitted."""
        self._fh.seek(0)
        self._fh.truncate()
        self._fh.write(json.dumps({"producer": producer, "namespace": namespace}) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._saved = True

    def close(self, *, complete: bool) -> None:
        """Unlock; the file goes when every record is in OUT (``complete``) or nothing was ever
        submitted, and stays for ``--resume`` otherwise."""
        if complete or not self._saved:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        self._fh.close()


def _locked_run(fh: IO[str], out: str, path: str, namespace: str, *, resume: bool) -> str | None:
    """Lock the run file ``fh`` and return the producer of the run it names (None: no run)."""
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ResumeError(f"{out} is being written by another redroll submit ({path} is locked)") from None
    fh.seek(0)
    try:
        saved = fh.read()  # (UnicodeDecodeError is a ValueError too)
        previous = json.loads(saved) if saved.strip() else None
        if previous is not None and not (isinstance(previous, dict) and isinstance(previous.get("producer"), str)):
            raise ValueError("no producer named")
    except ValueError as exc:
        raise ResumeError(f"{path} is not a run file of redroll submit ({exc}); delete it to start over") from None
    if previous is None:
        return None
    if not resume:
        raise ResumeError(f"{out} holds the records of an interrupted run whose requests may still be queued or in "
                          f"flight ({path} names its producer): add --resume to take them over, or delete {path} "
                          f"to start over")
    if previous.get("namespace") != namespace:
        raise ResumeError(f"{path} is a run in namespace {previous.get('namespace')!r}, not {namespace!r}")
    return previous["producer"]


class _RecordId(msgspec.Struct):
    request_id: str
    status: str


_record_id = msgspec.json.Decoder(_RecordId).decode


def records_written(out: str) -> dict[str, bool]:
    """The request_ids of the records in ``out``, each with whether it finished. A last line cut
    short (a run killed while writing) is cut off the file: its record is written again from the
    reply stream or the run."""
    done: dict[str, bool] = {}
    try:
        fh = open(out, "r+b")
    except FileNotFoundError:
        return done
    with fh:
        whole = 0  # (where the whole lines end)
        for n, line in enumerate(fh, 1):  # (a line at a time: records of long outputs make a large file)
            if not line.endswith(b"\n"):
                fh.truncate(whole)
                break
            whole += len(line)
            if not line.strip():
                continue
            try:
                record = _record_id(line)
            except msgspec.DecodeError as exc:
                raise ResumeError(f"{out}:{n}: not a record of redroll submit ({exc})") from None
            done[record.request_id] = record.status == FINISHED
    return done


async def move_records(r: Redis, reply_streams: list[str], wanted: set[str], written: set[str],
                       sink: IO[bytes]) -> dict[str, bool]:
    """Append to ``sink`` the records of ``wanted`` request_ids that are on the interrupted run's
    reply streams (one each, in arrival order); returns their request_ids, each with whether it
    finished. A page of entries at a time: its records are written and synced, then its entries
    deleted, together with those of records already ``written`` to OUT (a kill in between leaves
    duplicates there, which the next resume deletes). Entries that do not decode are left to the
    producer's reader, which dead-letters them."""
    moved: dict[str, bool] = {}
    encode = msgspec.json.Encoder().encode
    for stream in reply_streams:
        start = "-"
        while True:
            page = await r.xrange(stream, min=start, count=PAGE)
            lines: list[bytes] = []
            done: list[str] = []
            for raw_id, fields in page:
                try:
                    record = decode_record(fields)
                except ValidationError:
                    continue
                rid = record.request_id
                if rid in wanted and rid not in moved:
                    moved[rid] = record.ok
                    lines.append(encode(record) + b"\n")
                if rid in wanted or rid in written:
                    done.append(text(raw_id))
            if lines:
                write_all(sink, b"".join(lines))
                sink.flush()
                os.fsync(sink.fileno())
            if done:
                await _delete_entries(r, stream, done)
            if len(page) < PAGE:
                break
            start = "(" + text(page[-1][0])
    return moved


PAGE = 512
"""Reply-stream entries read at a time."""


def write_all(sink: IO[bytes], data: bytes) -> None:
    """``sink.write`` until all of ``data`` is in (OUT is opened unbuffered, and a file object
    without a buffer may take part of a write)."""
    view = memoryview(data)
    while view:
        written = sink.write(view)
        if not written:
            raise OSError(errno.EIO, "the file took none of a write")
        view = view[written:]


async def _delete_entries(r: Redis, stream: str, ids: list[str]) -> None:
    """Ack and delete reply-stream entries whose records are in OUT."""
    async with r.pipeline(transaction=True) as pipe:
        pipe.xack(stream, PRODUCER_GROUP, *ids)
        pipe.xdel(stream, *ids)
        acked, _ = await pipe.execute(raise_on_error=False)
    if isinstance(acked, Exception) and "NOGROUP" not in str(acked):  # (no group: a worker re-created the
        raise acked                                                   # stream after it expired)
