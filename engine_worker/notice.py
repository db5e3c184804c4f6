"""A worker given notice (SIGTERM, ``redroll drain``): what finishes here, and what goes at once.

A preemptible GPU is reclaimed a fixed time after its notice (Kubernetes' grace period, 30 s by
default; 30 s to 2 minutes on the big clouds). Told to stop, a worker stops claiming and sorts what
it holds (:func:`plan_notice`):

* a generation that will end inside the notice, judged from its tokens left (``max_new_tokens``
  less what it made) at the pace it has run at so far (its engine's partial output over its time
  running; for an engine that shows none, the pace of this worker's recent generations), finishes
  here;
* everything else — generations that would not end in time, entries waiting for a slot, for a
  hold or for new weights — is handed over at once: its generation aborted, what it made saved
  in one batched, lease-fenced write (:mod:`.checkpoint_writes`), the entries handed back to the
  fleet in one call per stream, and the fleet told on the control stream
  (:class:`~redroll.shared.commands.HandedBack`), so idle workers take them within a second and
  continue them (:mod:`.checkpoints` says which requests continue and which start over).

What was let run and has not ended when the notice is nearly over is handed over the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from redroll.engine_worker.flights import InFlight

NOTICE_SAFETY = 0.8
"""A generation is let run only if, at its pace so far, it ends within this share of the notice
(paces vary: a batch that empties speeds the rest up, one that fills slows them down)."""


class DecodeRate:
    """The pace of this worker's recent generations, in tokens a second per request (for engines
    that show no partial output): a moving average over the generations that finished here."""

    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self.tokens_per_s: float | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        pace = tokens / seconds
        self.tokens_per_s = pace if self.tokens_per_s is None else (
            self.weight * pace + (1.0 - self.weight) * self.tokens_per_s)


@dataclass
class NoticePlan:
    finish: list[InFlight] = field(default_factory=list)
    """Generations that end inside the notice at their pace: they finish here."""
    hand_over: list[InFlight] = field(default_factory=list)
    """Everything else: saved and handed back at once."""


def tokens_made(flight: InFlight, engine: Any, partial_output: bool) -> int | None:
    """Tokens this worker's generation of ``flight`` has made so far (its first sample), when the
    engine shows them; else None."""
    if not partial_output:
        return None
    snap = engine.partial(flight.handle)
    return None if snap is None else len(snap.token_ids)


def plan_notice(flights: Iterable[InFlight], engine: Any, partial_output: bool, rate: DecodeRate, window_s: float,
                now: float | None = None) -> NoticePlan:
    """Sort ``flights`` into what finishes within ``window_s`` seconds and what is handed over now."""
    now = time.monotonic() if now is None else now
    plan = NoticePlan()
    for flight in flights:
        if flight.handed_back:
            continue
        if flight.released:  # (its generation is over: its record is being published)
            plan.finish.append(flight)
            continue
        started, budget = flight.generation_started, flight.generation_budget
        if flight.task is None or started is None or budget is None:  # (waiting: nothing made yet)
            plan.hand_over.append(flight)
            continue
        running = max(1e-3, now - started)
        made = tokens_made(flight, engine, partial_output)
        pace = made / running if made else rate.tokens_per_s
        if made is None and pace is not None:
            made = int(pace * running)
        if not pace or made is None:
            plan.hand_over.append(flight)  # (no pace to judge by: what it made is saved, not risked)
            continue
        left = max(0, budget - made)
        (plan.finish if left / pace <= NOTICE_SAFETY * window_s else plan.hand_over).append(flight)
    return plan


__all__ = ["DecodeRate", "NOTICE_SAFETY", "NoticePlan", "plan_notice", "tokens_made"]
