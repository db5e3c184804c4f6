"""Which claiming worker owns which affinity lane: the same answer on every worker given the same names.

Consistent hashing with bounded loads: each worker has :data:`POINTS` points on a 64-bit ring (a
blake2b digest of its name and the point's number); lane ``j`` starts at its own point (the digest
of ``lane|j``) and goes clockwise to the first point whose worker holds fewer than ``ceil(L / W)``
lanes. Lanes are placed in index order, so every worker that sees the same member list computes the
same owners, with no coordinator. A worker that joins or leaves moves about ``L / W`` lanes (those
its points catch, or those it held) and the few that the cap pushes on: affinity survives a
change of the fleet.

Cost per change of the member list: a sort of ``W x POINTS`` points and ``L`` short walks, about
20 ms for a thousand workers and four thousand lanes; a name's points are hashed once and kept,
and the last plans are kept too (a host process running many workers computes each plan once).
Capped rendezvous hashing, used before, cost ``L x W`` hashes and kept ``L`` scores per worker on
every worker: hundreds of megabytes and seconds per change at that size.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
from dataclasses import dataclass
from typing import Iterable

POINTS = 16
"""Points per worker on the ring: more spread the lanes more evenly before the cap evens them out."""

_points_of: dict[str, list[int]] = {}


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def worker_points(name: str) -> list[int]:
    """``name``'s points on the ring (kept: a name's never change)."""
    points = _points_of.get(name)
    if points is None:
        if len(_points_of) > 100_000:  # (names of workers long gone)
            _points_of.clear()
        points = _points_of[name] = [_digest(f"{name}#{k}") for k in range(POINTS)]
    return points


@functools.lru_cache(maxsize=64)
def _lane_points(lanes: int) -> tuple[int, ...]:
    return tuple(_digest(f"lane|{j}") for j in range(lanes))


@functools.lru_cache(maxsize=16)
def _ring(names: tuple[str, ...]) -> tuple[list[int], list[int]]:
    """The ring of ``names``' points: the points in order, and the index of each one's worker."""
    ring = sorted((p, i) for i, name in enumerate(names) for p in worker_points(name))
    return [p for p, _ in ring], [i for _, i in ring]


@dataclass(frozen=True)
class Plan:
    """The lanes' owners for one member list."""

    owners: tuple[str | None, ...]
    """Lane -> its owner (None for every lane when nobody claims)."""
    by_owner: dict[str | None, tuple[int, ...]]
    """Owner -> its lanes, in order (what a worker looks up at every heartbeat: no walk over the lanes)."""

    def lanes_of(self, names: Iterable[str | None]) -> list[int]:
        """The lanes of ``names``' owners, in order."""
        return sorted(j for name in names for j in self.by_owner.get(name, ()))


@functools.lru_cache(maxsize=16)
def _plan(names: tuple[str, ...], lanes: int) -> Plan:
    if not names:
        return Plan((None,) * lanes, {None: tuple(range(lanes))})
    where, whose = _ring(names)
    size = len(where)
    cap = -(-lanes // len(names))
    load = [0] * len(names)
    owners: list[str | None] = []
    by_owner: dict[str | None, list[int]] = {}
    for j, start in enumerate(_lane_points(lanes)):
        k = bisect.bisect_left(where, start)
        while load[whose[k % size]] >= cap:
            k += 1
        i = whose[k % size]
        load[i] += 1
        owners.append(names[i])
        by_owner.setdefault(names[i], []).append(j)
    return Plan(tuple(owners), {name: tuple(js) for name, js in by_owner.items()})


def lane_plan(workers: Iterable[str], lanes: int) -> Plan:
    """The :class:`Plan` of ``lanes`` lanes among ``workers`` (kept: the last few are reused)."""
    return _plan(tuple(sorted(set(workers))), lanes)


def lane_owners(workers: Iterable[str], lanes: int) -> list[str | None]:
    """The owner of each of ``lanes`` lanes among ``workers`` (None for every lane when there is none)."""
    return list(lane_plan(workers, lanes).owners)


def lane_heirs(workers: Iterable[str], lanes: int, gone: set[str], which: Iterable[int]) -> dict[int, str | None]:
    """For each lane in ``which``: the first worker clockwise from its point on the ring that is
    not in ``gone`` (its heir while its owner is late: who looks after it until the next plan).
    The same on every worker given the same names; only those lanes' walks, no whole plan."""
    names = tuple(sorted(set(workers)))
    out: dict[int, str | None] = {}
    if not names:
        return {j: None for j in which}
    where, whose = _ring(names)
    points = _lane_points(lanes)
    size = len(where)
    for j in which:
        k = bisect.bisect_left(where, points[j])
        for step in range(size):
            name = names[whose[(k + step) % size]]
            if name not in gone:
                out[j] = name
                break
        else:
            out[j] = None
    return out
