"""Streamed calls (``stream: true``): server-sent events in OpenAI's shape.

A streamed call is one request per choice (:func:`~redroll.web.gateway.translate.build_requests`),
each one sample. Every request's chunks are read from Redis as its worker publishes them
(:func:`redroll.producer.stream_reader.stream_chunks`, on the gateway's ``wait_client``: each read
blocks one of its connections) until its record lands; the choices' chunks are merged as they
come, each tagged with its ``index``, and written as ``data: {json}`` events ending with
``data: [DONE]``.

The response starts with the call's first chunk: until then a failure (a worker's refusal, a
timeout, Redis unreachable) is answered with today's JSON error and status. After it, a record
that is not finished ends the stream with a ``data: {"error": {...}}`` event, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
import redis
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from redroll.producer.stream_reader import StreamChunk, stream_chunks
from redroll.shared.types import CompletionRecord, GenerationRequest
from redroll.web.gateway.idempotency import KeyedCall, timed_out
from redroll.web.gateway.logprobs import chat_logprobs, completion_logprobs
from redroll.web.gateway.protocol import ChatBody, CompletionBody, GatewayError
from redroll.web.gateway.tool_stream import ToolCallStream
from redroll.web.gateway.translate import chat_finish_reason, check_records, choice_extensions

log = logging.getLogger("redroll.web.gateway")

DONE = b"data: [DONE]\n\n"


def event(payload: Any) -> bytes:
    """One server-sent event: ``data: {json}`` and a blank line."""
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


# ------------------------------------------------------------------ reading the choices

@dataclass
class ChoiceStreams:
    """The chunk streams of a call's requests (one per choice, in choice order), and what to stop
    when the call's response ends: the record readers (the requests go on)."""

    streams: list[AsyncIterator[StreamChunk]]
    _tasks: list[asyncio.Task] = field(default_factory=list)
    _keyed: KeyedCall | None = None

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._keyed is not None:
            await self._keyed.close()


def open_choices(requests: list[GenerationRequest], records: list[Awaitable[CompletionRecord]],
                 wait_client: Any, timeout: float, keyed: KeyedCall | None, since: list[str]) -> ChoiceStreams:
    """Each request's chunks, read (from its place ``since`` in its chunk stream) until its record
    (from ``records``, within ``timeout`` seconds of now, else 504) lands."""
    deadline = time.monotonic() + timeout

    async def within(record: Awaitable[CompletionRecord]) -> CompletionRecord:
        try:
            return await asyncio.wait_for(asyncio.shield(record), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            if keyed is not None:
                raise timed_out(timeout) from None
            raise GatewayError(504, f"no record within {timeout:.0f} s (send an Idempotency-Key to be able to "
                                    "retry a call without running it twice)", kind="timeout", code="timeout") from None

    awaited: list[asyncio.Future] = []
    tasks = []
    for record in records:
        if isinstance(record, asyncio.Future) and record.done():  # (here already: the whole choice from it)
            awaited.append(record)
        else:
            tasks.append(asyncio.ensure_future(within(record)))
            awaited.append(tasks[-1])
    streams = [stream_chunks(wait_client, req, future, at) for req, future, at in zip(requests, awaited, since)]
    return ChoiceStreams(streams, tasks, keyed)


_END = object()


async def merge(streams: list[AsyncIterator[StreamChunk]]) -> AsyncIterator[tuple[int, StreamChunk]]:
    """(choice index, chunk) from every stream as they come; a stream's error is raised here.
    Closing this stops every stream."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[StreamChunk]) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((index, chunk))
        except Exception as exc:
            queue.put_nowait((index, exc))
        else:
            queue.put_nowait((index, _END))

    pumps = [asyncio.create_task(pump(i, s), name=f"stream-choice-{i}") for i, s in enumerate(streams)]
    try:
        running = len(pumps)
        while running:
            index, item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


# ------------------------------------------------------------------ writing the events

class EventWriter:
    """OpenAI's stream chunks of one call: ``text_completion`` objects for completions,
    ``chat.completion.chunk`` objects for chats, ``choices`` of one choice each."""

    def __init__(self, body: CompletionBody | ChatBody, call_id: str, model: str, created: int,
                 prompts: list[list[int] | None]):
        self.chat = isinstance(body, ChatBody)
        self.id = f"chatcmpl-{call_id}" if self.chat else f"cmpl-{call_id}"
        self.model = body.model or model
        self.created = created
        self.n = body.n
        self.prompts = prompts
        self.with_ids = bool(body.return_token_ids)
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.want_logprobs = bool(body.logprobs) if self.chat else body.logprobs is not None
        self.top = (body.top_logprobs or 0) if isinstance(body, ChatBody) else (body.logprobs or 0)
        self.records: dict[int, CompletionRecord] = {}
        self._started: set[int] = set()
        self.tools = ToolCallStream.of(body)
        """A chat whose text may hold tool calls: its content is held where a call may start."""

    def _object(self, choice: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                               "created": self.created, "model": self.model, "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def opening(self) -> bytes:
        """A chat's first chunk per choice: the assistant's role, no content yet (none for completions)."""
        if not self.chat:
            return b""
        out = []
        for index in range(self.n * len(self.prompts)):
            obj = self._object({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None})
            if self.with_ids and index == 0:
                obj["prompt_token_ids"] = self.prompts[0]
            out.append(event(obj))
        return b"".join(out)

    def chunk(self, index: int, chunk: StreamChunk) -> bytes:
        """One chunk of choice ``index`` (its last carries ``finish_reason``); b"" for nothing new.
        A last chunk whose record is not finished raises its :class:`GatewayError`."""
        rec = chunk.record
        if rec is not None:
            check_records([rec])
            self.records[index] = rec
        if not chunk.token_ids and not chunk.text and rec is None:
            return b""
        choice: dict[str, Any] = {"index": index}
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            content, calls = self.tools.take(index, chunk.text or "", rec)
            choice["delta"] = {"content": content}
        elif self.chat:
            choice["delta"] = {"content": chunk.text or ""}
        else:
            choice["text"] = chunk.text or ""
        choice["logprobs"] = self._logprobs(chunk, rec)
        choice["finish_reason"] = chunk.finish_reason if rec is not None else None
        if rec is not None and self.chat:
            choice["finish_reason"] = chat_finish_reason(rec, 0)
        choice["stop_reason"] = None
        top_level: dict[str, Any] = {}
        if self.with_ids:
            choice["token_ids"] = list(chunk.token_ids)
            sent = self.prompts[0 if self.chat else index // self.n]
            if not self.chat and index not in self._started and sent is not None:
                choice["prompt_token_ids"] = sent  # (a token-id prompt: on the choice's first chunk)
            elif sent is None and rec is not None and (self.chat and index == 0 or not self.chat):
                # (a text or a chat: the worker's rendering comes with the record, on the last chunk)
                (top_level if self.chat else choice)["prompt_token_ids"] = rec.prompt_token_ids
        if rec is not None:
            choice.update(choice_extensions(rec, 0, False))
        self._started.add(index)
        if calls:  # (OpenAI's shape: each call's head, then its arguments, then the finish)
            finish = {k: choice.pop(k) for k in ("finish_reason", "stop_reason", "weight_version") if k in choice}
            choice["finish_reason"] = None
            out = [event({**self._object(choice), **top_level})]
            out += [event(self._object({"index": index, "delta": {"tool_calls": [delta]}, "logprobs": None,
                                        "finish_reason": None})) for delta in calls]
            out.append(event(self._object({"index": index, "delta": {}, "logprobs": None, **finish})))
            return b"".join(out)
        return event({**self._object(choice), **top_level})

    def _logprobs(self, chunk: StreamChunk, rec: CompletionRecord | None) -> dict[str, Any] | None:
        """The chunk's tokens' logprobs and (``top_logprobs``) their k most likely tokens each."""
        if not self.want_logprobs:
            return None
        ids = list(chunk.token_ids)
        lps = list(chunk.logprobs) if chunk.logprobs is not None else None
        if lps is None and rec is not None and rec.output_logprobs is not None:
            lps = rec.output_logprobs[0][chunk.offset:chunk.offset + len(ids)]
        lps = lps or [None] * len(ids)
        tops: list[list[tuple[int, float]]] = [[] for _ in ids]
        if self.top and chunk.top_logprobs is not None and len(chunk.top_logprobs) == len(ids):
            tops = [list(t) for t in chunk.top_logprobs]
        elif self.top and rec is not None and rec.output_top_logprobs:
            tops = list(rec.output_top_logprobs[0][chunk.offset:chunk.offset + len(ids)]) or tops
        build = chat_logprobs if self.chat else completion_logprobs
        return build(ids, lps, tops, self.top)

    def usage(self) -> dict[str, int]:
        """The call's usage: each prompt counted once (its choices all read it), every sample's tokens."""
        prompt = sum(int(self.records[k * self.n].meta_info.get("prompt_tokens") or 0)
                     for k in range(len(self.prompts)) if k * self.n in self.records)
        completion = sum(len(rec.output_token_ids[0]) for rec in self.records.values() if rec.output_token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def usage_event(self) -> bytes:
        return event({"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                      "created": self.created, "model": self.model, "choices": [], "usage": self.usage()})


def error_event(exc: GatewayError) -> bytes:
    return event(exc.body())


# ------------------------------------------------------------------ the response

class EventStream(StreamingResponse):
    """``text/event-stream``; ``finish`` runs when the response ends however it ends (a client
    gone mid-stream, or before the first byte was sent, included), so that its readers stop at once."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], finish: Callable[[], Awaitable[None]]):
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._finish = finish

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()  # type: ignore[attr-defined]
            await self._finish()


async def respond(writer: EventWriter, choices: ChoiceStreams, on_end: Callable[[int], None],
                  before_done: Callable[[], Awaitable[None]] | None = None) -> EventStream:
    """The call's response once its first chunk is here (a failure before it raises, for a JSON
    error); ``on_end(completion tokens)`` runs once when the stream ends, however it ends;
    ``before_done()`` once the last chunk is sent, before ``[DONE]`` (a session's turn is kept
    then, so that the client's next call finds it)."""
    items = merge(choices.streams)
    ended = False

    async def finish() -> None:
        nonlocal ended
        if ended:
            return
        ended = True
        await items.aclose()
        await choices.close()
        on_end(writer.usage()["completion_tokens"])

    try:
        first = await anext(items)
        head = writer.opening() + writer.chunk(*first)
    except BaseException:
        await finish()
        raise

    async def events() -> AsyncIterator[bytes]:
        yield head
        try:
            async for index, chunk in items:
                data = writer.chunk(index, chunk)
                if data:
                    yield data
            if writer.include_usage:
                yield writer.usage_event()
            if before_done is not None:
                await before_done()
        except GatewayError as exc:
            yield error_event(exc)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            log.warning("a stream lost Redis: %s", exc)
            yield error_event(GatewayError(503, f"Redis is unreachable ({exc}); retry later", kind="server_error",
                                           code="unavailable"))
        except Exception as exc:  # (a bug: the stream still ends in OpenAI's shape, and it is logged)
            log.exception("a stream failed")
            yield error_event(GatewayError(500, f"internal error: {exc}", kind="server_error", code="internal"))
        yield DONE
        await finish()

    return EventStream(events(), finish)


__all__ = ["ChoiceStreams", "EventStream", "EventWriter", "merge", "open_choices", "respond", "DONE"]
