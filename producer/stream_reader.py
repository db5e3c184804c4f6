"""Reading a streamed request: its chunks while it generates, then the rest from its record.

A producer's streamed requests (``stream``) share a chunk stream beside its reply stream,
``{tag}:chunks:<producer>``: one entry per worker call, holding each chunk that call saved, named
by its request_id and the token offset it starts at (``shared/chunks.py``). Chunks are not
records: the request still gets its one record on its reply stream, the promise every reader
relies on. :func:`stream_chunks` reads the chunk stream from a place before the request's first
chunk (``since``: the stream's end when the request was submitted, or its start) while the record
is awaited, keeps only the request's chunk that starts where the reader is (a chunk it has, or one
of an earlier attempt that started over, is dropped), and ends with one last chunk made from the
record: whatever the record holds past what was yielded, with the finish reason and the record
itself. So a reader gets every token once, in order, whether the request ran on one worker or
continued on another after a death (the chunks go on from the saved offset), and a reader that
comes late (a gateway's retry: a keyed call has a chunk stream of its own) gets it all the same.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any, AsyncIterator, Awaitable

import msgspec

from redroll.shared.chunks import Part, chunks_by_request, part_of
from redroll.shared.keys import chunks_key_for
from redroll.shared.streams import id_tuple
from redroll.shared.streams import text as as_text
from redroll.shared.types import CompletionRecord, GenerationRequest

log = logging.getLogger("redroll.producer")

READ_BLOCK_MS = 1000
"""How long one XREAD waits for chunks (the record's arrival ends the wait sooner)."""
REJOIN_S = 0.002
"""A stream opened while the shared read is under way waits this long before that read is let go
for one that names it, so that streams opened together cost one new read."""


class StreamChunk(msgspec.Struct, kw_only=True):
    """A piece of a streamed request's output, in order."""

    request_id: str
    offset: int
    """The token offset of ``token_ids[0]`` in the sample's output."""
    token_ids: list[int]
    text: str | None = None
    """The text these tokens add (None: the request wants no text)."""
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """With ``top_logprobs_num``: per token, the k most likely (token id, logprob) pairs."""
    finish_reason: str | None = None
    """Set on the last chunk only (from the record): "stop", "length", "abort", or None for a
    request that never ran (an error, an abort before it started)."""
    record: CompletionRecord | None = None
    """The request's record, on the last chunk only."""


class StreamAssembler:
    """Puts one request's chunks in order, dropping what the reader has, and makes the last chunk
    from its record."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.tokens = 0
        """Tokens handed out so far."""
        self.text = ""
        """Their text."""

    def take(self, offset: int, part: Part) -> StreamChunk | None:
        """The chunk to hand out for ``part`` (saved at ``offset``), or None when it is not next."""
        if offset != self.tokens or not part.token_ids:
            return None
        self.tokens += len(part.token_ids)
        self.text += part.text or ""
        return StreamChunk(request_id=self.request_id, offset=offset, token_ids=list(part.token_ids),
                           text=part.text, logprobs=part.logprobs, top_logprobs=part.top_logprobs)

    def last(self, record: CompletionRecord) -> StreamChunk:
        """What ``record`` holds past what was handed out, with its finish reason and itself."""
        ids = record.output_token_ids[0] if record.output_token_ids else []
        logprobs = record.output_logprobs[0] if record.output_logprobs else None
        tops = record.output_top_logprobs[0] if record.output_top_logprobs else None
        full = record.output_text[0] if record.output_text else None
        text = None
        if full is not None:
            if not full.startswith(self.text):
                log.warning("request %s: its record's text does not continue what its chunks sent",
                            self.request_id)
            text = full[len(self.text):]
        offset = self.tokens
        self.tokens = max(self.tokens, len(ids))
        self.text = full if full is not None else self.text
        return StreamChunk(request_id=self.request_id, offset=offset, token_ids=list(ids[offset:]), text=text,
                           logprobs=list(logprobs[offset:]) if logprobs is not None else None,
                           top_logprobs=[list(t) for t in tops[offset:]] if tops is not None else None,
                           finish_reason=record.finish_reasons[0] if record.finish_reasons else None, record=record)


def chunks_key(request: GenerationRequest) -> str:
    """Where ``request``'s chunks are (it must have its reply stream set)."""
    key = chunks_key_for(request.reply_to or "")
    if key is None:
        raise ValueError(f"request {request.request_id!r} streams beside a producer's reply stream, "
                         f"not {request.reply_to!r}")
    return key


class _Reader:
    """One request's place in a :class:`ChunkReads`: the chunks read for it, in order."""

    def __init__(self, key: str, request_id: str, since: str):
        self.key = key
        self.request_id = request_id
        self.last_id: bytes | str = since
        """The last entry handed out (entries at or before it are dropped: two reads may bring one twice)."""
        self.queued_to: bytes | str = since
        """The last entry the shared read looked at for it (the next shared read goes on after it)."""
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    @property
    def place(self) -> bytes | str:
        """Where the next read for it starts: after what it was handed or was looked at for it."""
        return max(self.last_id, self.queued_to, key=_id_of)

    def fresh(self, entries: list) -> list:
        """The entries of ``entries`` after the last one handed out (which they then are)."""
        out = []
        last = _id_of(self.last_id)
        for entry_id, chunks in entries:
            at = _id_of(entry_id)
            if at > last:
                out.append((entry_id, chunks))
                last, self.last_id = at, entry_id
        return out


class ChunkReads:
    """One blocking XREAD for all the chunk streams a client reads in one hash tag: a producer
    streaming many requests at once reads its one chunk stream, woken once per batch of chunks its
    workers wrote (a worker writes all its chunks of one call as one entry), and holds one
    connection for all of them. A gateway reads its own chunk stream and those of its keyed calls
    (each has its own) in the same read. A stream that opens while the shared read is under way is
    named by the next one: the read under way is let go (after :data:`REJOIN_S`, so that streams
    opening together cost one new read) and a new one, naming them all, takes its place."""

    _all: "weakref.WeakKeyDictionary[Any, dict[str, ChunkReads]]" = weakref.WeakKeyDictionary()

    def __init__(self, redis: Any):
        self.redis = redis
        self.readers: list[_Reader] = []
        self._task: asyncio.Task | None = None
        self._rejoin: asyncio.TimerHandle | None = None
        self._joined = asyncio.Event()
        """Set when streams opened since the read under way began: read again, naming them."""
        self.reads = 0
        """Shared reads made (each one XREAD for every stream open then)."""
        self._reading: dict[str, Any] = {}
        """The read under way: each stream it names, from where."""
        self._marking: dict[str, asyncio.Future] = {}
        """Reads of a stream's end under way (:meth:`mark`)."""

    @classmethod
    def of(cls, redis: Any, key: str) -> "ChunkReads":
        """The shared reads of ``redis`` for the hash tag of ``key``."""
        by_tag = cls._all.setdefault(redis, {})
        tag = key[: key.index("}") + 1] if key.startswith("{") and "}" in key else ""
        reads = by_tag.get(tag)
        if reads is None:
            reads = by_tag[tag] = cls(redis)
        return reads

    async def mark(self, key: str) -> str:
        """A place in ``key`` before every entry written from now on: where a reader of a request
        about to be submitted starts (the place the shared read is at, or the stream's last entry)."""
        places = [r.place for r in self.readers if r.key == key]
        if places:
            return as_text(min(places, key=_id_of))
        # (streams opened together share one read of the end: any place from before a submit will do)
        asking = self._marking.get(key)
        if asking is None:
            asking = self._marking[key] = asyncio.ensure_future(self.redis.xrevrange(key, count=1))
            asking.add_done_callback(lambda _: self._marking.pop(key, None))
        last = await asyncio.shield(asking)
        return as_text(last[0][0]) if last else "0-0"

    def open(self, key: str, request_id: str, since: str = "0-0") -> _Reader:
        reader = _Reader(key, request_id, since)
        self.readers.append(reader)
        reading = self._reading.get(key)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())
        elif self._rejoin is None and (reading is None or _id_of(since) < _id_of(reading)):
            # (the read under way does not cover it: a new one will)
            self._rejoin = asyncio.get_running_loop().call_later(REJOIN_S, self._rejoined)
        return reader

    def _rejoined(self) -> None:
        self._rejoin = None
        self._joined.set()

    def close(self, reader: _Reader) -> None:
        if reader in self.readers:
            self.readers.remove(reader)

    async def _run(self) -> None:
        """Read while streams are open (the last read ends by itself within its block)."""
        while self.readers:
            self._joined.clear()
            positions: dict[str, Any] = {}
            for r in self.readers:  # (a stream read for several readers: from the earliest place of them)
                at = r.place
                if r.key not in positions or _id_of(at) < _id_of(positions[r.key]):
                    positions[r.key] = at
            self._reading = positions
            read = asyncio.ensure_future(self.redis.xread(positions, block=READ_BLOCK_MS))
            joined = asyncio.ensure_future(self._joined.wait())
            try:
                await asyncio.wait({read, joined}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                joined.cancel()
            if not read.done():
                # Streams opened since: read again, naming them. This read is let go (not awaited:
                # a cancellation inside a Redis call can be swallowed on Python 3.11; it ends by
                # itself within READ_BLOCK_MS, its result dropped: the next read brings its entries).
                read.cancel()
                read.add_done_callback(_drop)
                continue
            if read.exception() is not None:  # (every stream reading now meets it, as each read alone did)
                for r in self.readers:
                    r.queue.put_nowait(read.exception())
                return
            self.reads += 1
            for key, entries in read.result() or ():
                self._hand_out(as_text(key), _id_of(positions[as_text(key)]), entries)

    def _hand_out(self, key: str, read_from: tuple[int, int], entries: list) -> None:
        """Each reader of ``key`` whose place the read covered (it read from there or before) gets
        the chunks of its request in ``entries`` past its place."""
        readers = [r for r in self.readers if r.key == key]
        if not readers or not entries:
            return
        parsed = [(entry_id, _id_of(entry_id), chunks_by_request(fields)) for entry_id, fields in entries]
        for r in readers:
            after = _id_of(r.queued_to)
            if read_from > after:
                continue  # (opened since, from an earlier place: the next read starts there)
            mine = [(entry_id, chunks[r.request_id]) for entry_id, at, chunks in parsed
                    if at > after and r.request_id in chunks]
            if _id_of(entries[-1][0]) > after:
                r.queued_to = entries[-1][0]
            if mine:
                r.queue.put_nowait(mine)


def _id_of(entry_id: Any) -> tuple[int, int]:
    return id_tuple(as_text(entry_id))


async def stream_chunks(redis: Any, request: GenerationRequest, record: Awaitable[CompletionRecord],
                        since: str = "0-0") -> AsyncIterator[StreamChunk]:
    """The chunks of ``request`` (submitted, its ``reply_to`` set), ending with the one made from
    ``record`` (what resolves to its record: a producer's future, a keyed call's reader). ``redis``:
    the client whose connection the shared blocking XREAD holds (one read for all the streams it
    reads: :class:`ChunkReads`). ``since``: a place in the chunk stream before the request's first
    chunk (:meth:`ChunkReads.mark` taken before its submit; the stream's start by default)."""
    key = chunks_key(request)
    assembler = StreamAssembler(request.request_id)
    owned = not isinstance(record, asyncio.Future)
    waiting = asyncio.ensure_future(record)
    reads = ChunkReads.of(redis, key)
    reader = reads.open(key, request.request_id, since)
    read: asyncio.Future | None = None
    try:
        while not waiting.done():
            if read is None:
                read = asyncio.ensure_future(reader.queue.get())
            await asyncio.wait({read, waiting}, return_when=asyncio.FIRST_COMPLETED)
            if not read.done():
                break  # (the record came: it holds the rest)
            got, read = read.result(), None
            if isinstance(got, Exception):
                raise got
            for entry_id, chunks in reader.fresh(got):
                for offset, data in chunks:
                    part = part_of(data)
                    if part is None:
                        log.warning("a chunk of %s in entry %s of %s is not one", request.request_id,
                                    as_text(entry_id), key)
                        continue
                    chunk = assembler.take(offset, part)
                    if chunk is not None:
                        yield chunk
        yield assembler.last(await waiting)
    finally:
        reads.close(reader)
        if read is not None and not read.done():
            read.cancel()
        if owned and not waiting.done():
            waiting.cancel()


def _drop(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # (retrieved: a read let go has nobody to tell)


__all__ = ["READ_BLOCK_MS", "ChunkReads", "StreamAssembler", "StreamChunk", "chunks_key", "stream_chunks"]
