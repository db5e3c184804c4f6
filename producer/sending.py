"""Fire-and-forget submits: :func:`send` and :func:`send_each` queue requests whose records go
to a results stream (for consumer groups), and the batched submit they and the producer share."""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any, Iterable

from redis.asyncio import Redis

from redroll.observability.tracing import end_span, submit_span, tracer
from redroll.producer.request import request_stream
from redroll.shared.codec import ValidationError, encode_request
from redroll.shared.connection.durability import Durability
from redroll.shared.connection.sentinel import leave_demoted_primary
from redroll.shared.events import EventLog
from redroll.shared.keys import Keys
from redroll.shared.lanes import agree_on_lanes
from redroll.shared.refusals import StreamRefusedError, is_transient
from redroll.shared.scripts import DuplicateRequestError, Scripts, call_replies, submit_refused, with_library
from redroll.shared.settings import Settings
from redroll.shared.streams import text
from redroll.shared.types import GenerationRequest

log = logging.getLogger("redroll.producer")


async def send(
    settings: Settings,
    redis_client: Redis,
    requests: Iterable[GenerationRequest],
    *,
    reply_to: str | None = None,
) -> list[str]:
    """Fire-and-forget: queue requests whose records go to ``reply_to`` (default ``{ns}:results``),
    for consumer groups to handle. Returns the request entry ids. A request Redis refused raises
    its error (:class:`DuplicateRequestError`, :class:`StreamRefusedError`) once the others are
    queued: :func:`send_each` reports each item instead."""
    outcomes = await send_each(settings, redis_client, requests, reply_to=reply_to)
    for outcome in outcomes:
        if isinstance(outcome, Exception):
            raise outcome
    return outcomes  # type: ignore[return-value]


async def send_each(
    settings: Settings,
    redis_client: Redis,
    requests: Iterable[GenerationRequest],
    *,
    reply_to: str | None = None,
) -> list[str | DuplicateRequestError | StreamRefusedError]:
    """:func:`send`, one outcome per request, in order: its entry id, or why it was not queued."""
    scripts = Scripts(redis_client, EventLog.from_settings(settings))
    tr, spans = tracer(), []  # (OpenTelemetry, when a tracer provider is set: redroll/observability/tracing.py)
    prepared = []
    for req in requests:
        part = settings.keys_for(req)
        target = reply_to or part.results
        if not part.is_reply_key(target):
            raise ValidationError("reply_to", f"{target!r} is not a result or reply stream of this request's "
                                              f"partition ({part.tag})")
        req.reply_to = target
        if tr is not None:
            spans.append(submit_span(tr, req))
        prepared.append((req, encode_request(req, settings.limits)))
    if settings.affinity_lanes:  # a producer with another L would queue on lanes nobody reads
        await agree_on_lanes(redis_client, settings.keys, settings.affinity_lanes)
    token_base = secrets.token_hex(8)
    items = [(req, fields["data"], f"send:{token_base}:{i}") for i, (req, fields) in enumerate(prepared)]
    replies = await submit_until_accepted(lambda chunk: submit_batch(redis_client, scripts, settings, chunk), items,
                                          "send")
    outcomes: list[str | DuplicateRequestError | StreamRefusedError] = []
    for (req, _), reply in zip(prepared, replies):
        try:
            outcomes.append(Scripts.submit_outcome(req.request_id, reply).entry_id)
        except (DuplicateRequestError, StreamRefusedError) as exc:
            outcomes.append(exc)
    for span in spans:
        end_span(span)
    return outcomes


async def submit_until_accepted(submit: Any, items: list, what: str) -> list:
    """``await submit(items)``; the items Redis refuses for a passing reason (out of memory, a
    read-only replica) are submitted again, with their own tokens, until it takes them: a submit
    waits, nothing is dropped (other refusals are the caller's, per item). One reply per item."""
    replies = await submit(items)
    delay, said = 0.2, False
    while True:
        waiting = [i for i, reply in enumerate(replies)
                   if int(reply[0]) == 3 and is_transient(text(reply[1]).partition(": ")[2])]
        if not waiting:
            if said:
                log.info("%s: Redis accepts submits again", what)
            return replies
        if not said:
            log.error("%s: Redis refuses %d submit(s) (%s); retrying until it accepts them", what, len(waiting),
                      text(replies[waiting[0]][1]))
            said = True
        await asyncio.sleep(delay)
        delay = min(delay * 2, 2.0)
        for i, reply in zip(waiting, await submit([items[i] for i in waiting])):
            replies[i] = reply


SUBMIT_CHUNK = 500
"""Requests per submit_many script call (a script blocks the server while it runs)."""


class SubmitCalls:
    """The ``submit_many`` calls of (request, data, token) items: one per request stream (in each
    request's partition), at most :data:`SUBMIT_CHUNK` items each. :meth:`queue` puts them on a
    pipeline (or a transaction); :meth:`replies` reads the pipeline's replies for them back as one
    [code, value] reply per item, in the items' order (:meth:`Scripts.submit_outcome` says what each
    means; a missing library raises :class:`~redroll.shared.functions.FunctionsMissingError` there,
    for :func:`~redroll.shared.scripts.with_library`). Every submit, the producer's and a keyed
    call's, is made of these."""

    def __init__(self, scripts: Scripts, settings: Settings, items: list[tuple[GenerationRequest, bytes, str]]):
        self.scripts = scripts
        self.settings = settings
        self.items = items
        groups: dict[tuple[str, Keys], list[int]] = {}
        for i, (req, _, _) in enumerate(items):
            part = settings.keys_for(req)
            groups.setdefault((request_stream(part, req), part), []).append(i)
        self.calls = [(stream, part, idx[j:j + SUBMIT_CHUNK]) for (stream, part), idx in groups.items()
                      for j in range(0, len(idx), SUBMIT_CHUNK)]

    def queue(self, pipe: Any) -> None:
        items = self.items
        for stream, part, idx in self.calls:
            self.scripts.submit_many_in(pipe, requests_key=stream, rid_ttl_s=self.settings.rid_ttl_s, items=[
                (part.rid(items[i][0].request_id), items[i][2], items[i][0].request_id, items[i][0].reply_to,
                 items[i][1], items[i][0].lane_key if part.lanes else items[i][0].affinity_key) for i in idx])

    def replies(self, pipe_replies: list) -> list:
        per_call = call_replies(pipe_replies, [submit_refused(stream, len(idx)) for stream, _, idx in self.calls])
        out: list = [None] * len(self.items)
        for (_, _, idx), reply in zip(self.calls, per_call):
            for i, rep in zip(idx, reply):
                out[i] = rep
        return out


async def submit_batch(r: Redis, scripts: Scripts, settings: Settings,
                       items: list[tuple[GenerationRequest, bytes, str]]) -> list:
    """Submit (request, data, token) items (:class:`SubmitCalls`) in one round trip; returns one
    [code, value] reply per item, in order (see :meth:`Scripts.submit_outcome`). With
    ``settings.wait_replicas`` the round trip ends with the replicas' acknowledgement (see
    :mod:`redroll.shared.connection.durability`)."""
    calls = SubmitCalls(scripts, settings, items)
    durability = Durability.of(settings)

    async def attempt() -> list:
        async with r.pipeline(transaction=False) as pipe:
            calls.queue(pipe)
            return calls.replies(await durability.execute(pipe))

    out = await with_library(r, attempt)
    await leave_demoted_primary(r, [text(rep[1]) for rep in out if int(rep[0]) == 3])
    return out
