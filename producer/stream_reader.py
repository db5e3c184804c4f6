"""Reading a streamed request: its chunks while it generates, then the rest from its record.

A streamed request (``stream``) has a chunk stream beside its reply stream,
``{tag}:chunks:<producer>}<request_id>``: one entry per part its worker saved, each with the token
offset it starts at (``shared/chunks.py``). Chunks are not records: the request still gets its one
record on its reply stream, the promise every reader relies on. :func:`stream_chunks` reads the
chunk stream from its start while the record is awaited, keeps only the chunk that starts where
the reader is (a chunk it has, or one of an earlier attempt that started over, is dropped), and
ends with one last chunk made from the record: whatever the record holds past what was yielded,
with the finish reason and the record itself. So a reader gets every token once, in order,
whether the request ran on one worker or continued on another after a death (the chunks go on
from the saved offset), and a reader that comes late (a gateway's retry) gets it all the same.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable

import msgspec

from redroll.shared.chunks import Part, chunk_of
from redroll.shared.keys import chunks_key_for
from redroll.shared.streams import text as as_text
from redroll.shared.types import CompletionRecord, GenerationRequest

log = logging.getLogger("redroll.producer")

READ_BLOCK_MS = 1000
"""How long one XREAD waits for chunks (the record's arrival ends the wait sooner)."""


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
    key = chunks_key_for(request.reply_to or "", request.request_id)
    if key is None:
        raise ValueError(f"request {request.request_id!r} streams beside a producer's reply stream, "
                         f"not {request.reply_to!r}")
    return key


async def stream_chunks(redis: Any, request: GenerationRequest,
                        record: Awaitable[CompletionRecord]) -> AsyncIterator[StreamChunk]:
    """The chunks of ``request`` (submitted, its ``reply_to`` set), ending with the one made from
    ``record`` (what resolves to its record: a producer's future, a keyed call's reader). ``redis``:
    the client whose connection each blocking XREAD holds."""
    key = chunks_key(request)
    assembler = StreamAssembler(request.request_id)
    owned = not isinstance(record, asyncio.Future)
    waiting = asyncio.ensure_future(record)
    last_id: bytes | str = "0-0"
    read: asyncio.Future | None = None
    try:
        while not waiting.done():
            read = asyncio.ensure_future(redis.xread({key: last_id}, block=READ_BLOCK_MS))
            await asyncio.wait({read, waiting}, return_when=asyncio.FIRST_COMPLETED)
            if not read.done():
                break  # (the record came: it holds the rest; the read is let go in ``finally``)
            entries_read, read = read.result(), None
            for _, entries in entries_read or ():
                for entry_id, fields in entries:
                    last_id = entry_id
                    parsed = chunk_of(fields)
                    if parsed is None:
                        log.warning("entry %s of %s is not a chunk", as_text(entry_id), key)
                        continue
                    chunk = assembler.take(*parsed)
                    if chunk is not None:
                        yield chunk
        yield assembler.last(await waiting)
    finally:
        if read is not None and not read.done():
            # Not awaited: a cancellation that lands inside a Redis call can be swallowed there
            # (asyncio.wait_for on Python 3.11), and the read would then hold the stream's end for
            # the rest of its block. It ends by itself within READ_BLOCK_MS; its result is dropped.
            read.cancel()
            read.add_done_callback(_drop)
        if owned and not waiting.done():
            waiting.cancel()


def _drop(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # (retrieved: a read let go has nobody to tell)


__all__ = ["READ_BLOCK_MS", "StreamAssembler", "StreamChunk", "chunks_key", "stream_chunks"]
