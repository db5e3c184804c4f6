"""The producer's requests, from submit to record: the one owner of that state.

A :class:`Pending` is one request a caller waits for (arq's ``Job``, the worker's in-flight
entry): its future and callback. :class:`PendingRequests` holds them, the records that came for
nobody (a restarted producer's, held for :meth:`~redroll.producer.client.Producer.unclaimed`),
the request_ids applied lately (a duplicate record is skipped, as ROLL pops its callback), and
the request_ids whose submit is on its way (a record of one is acked only once that submit
answered: see :meth:`PendingRequests.hold_acks`). The submit path (:mod:`.client`) and the reply
reader (:mod:`.replies`) both act on it; neither reads the other's fields.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable

from redroll.shared.types import CompletionRecord, RecordStatus

log = logging.getLogger("redroll.producer")

Callback = Callable[[CompletionRecord], Any]
EntryId = tuple[str, str]
"""(reply stream, entry id) of a record."""
Ack = tuple[EntryId, str]
"""A reply entry to ack, with its record's request_id."""

RECENT_LIMIT = 100_000
"""How many applied request_ids are remembered to skip duplicate records."""


@dataclass(eq=False)
class Pending:
    """One request a caller waits for: resolved once, with its record."""

    request_id: str
    future: asyncio.Future
    callback: Callback | None = None

    async def resolve(self, record: CompletionRecord) -> None:
        """Run the callback (sync or async; what it raises is logged), then resolve the future."""
        if self.callback is not None:
            try:
                res = self.callback(record)
                if inspect.isawaitable(res):
                    await res
            except Exception:
                log.exception("callback for request %s raised", record.request_id)
        if not self.future.done():
            self.future.set_result(record)


class PendingRequests:
    """Every request of one producer between its submit and its record (see the module)."""

    def __init__(self, on_given_back: Callable[[int], None] = lambda n: None):
        self.waiting: dict[str, Pending] = {}
        self.held: dict[str, tuple[EntryId, CompletionRecord]] = {}
        """request_id → the record that came with nobody waiting, and its entry (unacked until handed out)."""
        self.recent: dict[str, tuple[EntryId | None, CompletionRecord | None]] = {}
        """request_id → (the entry its record was applied from, a later record of the same id or None)."""
        self.submitting: set[str] = set()
        """request_ids whose submit is on its way."""
        self._acks_after_submit: list[Ack] = []
        self._held_event = asyncio.Event()
        self._on_given_back = on_given_back
        """Called with 1 for each record that brought no sample (aborted, failed): the staleness
        capacity its request took is given back (:class:`~.admission.Admission`)."""

    def __len__(self) -> int:
        return len(self.waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.waiting

    def expect(self, request_id: str, callback: Callback | None = None) -> Pending:
        pending = Pending(request_id, asyncio.get_running_loop().create_future(), callback)
        self.waiting[request_id] = pending
        return pending

    def forget(self, request_id: str) -> None:
        self.waiting.pop(request_id, None)

    def cancel_all(self) -> None:
        for pending in self.waiting.values():
            if not pending.future.done():
                pending.future.cancel()

    # ---------------------------------------------------------------- records

    async def resolve(self, record: CompletionRecord, entry_id: EntryId | None = None) -> bool:
        """Hand ``record`` to its waiter (callback, future); True when its entry can be acked now
        (False: held for :meth:`take_held`, which acks it when it hands it out)."""
        pending = self.waiting.pop(record.request_id, None)
        if pending is None:
            if record.request_id in self.recent:
                # Already applied here: skipped (ROLL's pop). A record from another entry is kept
                # for result(fresh=True) (a requeued request's new record may arrive before that
                # call); the applied entry itself, read again after a lost ack, is not.
                applied_from = self.recent[record.request_id][0]
                if entry_id is None or entry_id != applied_from:
                    self.recent[record.request_id] = (applied_from, record)
            elif entry_id is not None and self.held.get(record.request_id, (None,))[0] == entry_id:
                return False  # the held entry itself, read again (a lost reply): pending until handed out
            elif record.request_id in self.held or entry_id is None:
                pass  # a duplicate of a record not yet handed out, or a notice nobody waits for
            else:
                self.held[record.request_id] = (entry_id, record)
                self._held_event.set()
                return False
            return True
        await pending.resolve(record)
        self.remember(record.request_id, entry_id)
        if record.status is not RecordStatus.FINISHED:
            self._on_given_back(1)  # no sample came of it
        return True

    def remember(self, request_id: str, entry_id: EntryId | None) -> None:
        """Remember applied request_ids (and the entry each came from) for a while, so a duplicate
        record is skipped, not re-applied."""
        self.recent[request_id] = (entry_id, None)
        if len(self.recent) > RECENT_LIMIT:
            self.recent.pop(next(iter(self.recent)))

    def take_held(self, request_id: str | None = None) -> tuple[EntryId, CompletionRecord] | None:
        """A held record (of ``request_id``, or the oldest), now remembered as applied: the caller
        acks its entry. None when there is none."""
        if request_id is None:
            if not self.held:
                return None
            request_id = next(iter(self.held))
        held = self.held.pop(request_id, None)
        if held is not None:
            self.remember(request_id, held[0])
        return held

    async def wait_for_held(self) -> None:
        """Return once a record is held (at once when one is)."""
        if not self.held:
            self._held_event.clear()
            await self._held_event.wait()

    def wake(self) -> None:
        self._held_event.set()

    # ---------------------------------------------------------------- submits on their way

    def hold_acks(self, done: list[Ack]) -> list[Ack]:
        """Of the acks ``done``, those to make now: the ack of a record whose request_id's submit
        is on its way waits for that submit's reply (:meth:`end_submit`), so the submit meets the
        record's finished mark and does not queue it again (a resumed producer's, or a retry
        after a lost reply)."""
        if not self.submitting:
            return done
        self._acks_after_submit += [d for d in done if d[1] in self.submitting]
        return [d for d in done if d[1] not in self.submitting]

    def begin_submit(self, request_ids: set[str]) -> None:
        self.submitting |= request_ids

    def end_submit(self, request_ids: set[str]) -> list[Ack]:
        """The submit of ``request_ids`` answered: the acks of their records that came meanwhile,
        to make now."""
        self.submitting -= request_ids
        now = [a for a in self._acks_after_submit if a[1] in request_ids]
        if now:
            self._acks_after_submit = [a for a in self._acks_after_submit if a[1] not in request_ids]
        return now

    def counts(self) -> dict[str, int]:
        """What a reader counts as its own pending entries (held records, by stream)."""
        out: dict[str, int] = {}
        for (stream, _id), _rec in self.held.values():
            out[stream] = out.get(stream, 0) + 1
        return out
