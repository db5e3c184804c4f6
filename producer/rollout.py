"""RL rollout helpers: sample groups with dynamic sampling, partial rollouts, staleness figures.

A group is one prompt's n samples submitted as n requests sharing a ``group_id`` (so each sample
finishes, and can be aborted, on its own). ``take(k, accept)`` keeps the first k samples a filter
accepts and aborts the rest, as ROLL's scheduler does with ``abort_requests``; every member is
reported (accepted, rejected, surplus, aborted or failed), none is lost.
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable, Protocol

from redroll.shared.continuing import continue_after, join_parts
from redroll.shared.tally import Tally
from redroll.shared.types import CompletionRecord, GenerationRequest, RecordStatus


class Aborter(Protocol):
    """What a group needs of its producer (:class:`redroll.producer.client.Producer`)."""

    async def abort(self, request_ids: Iterable[str] = (), *, group_id: str | None = None) -> list[str]: ...


@dataclass
class GroupOutcome(Tally):
    """Every member of a group, each in exactly one list: ``accepted`` (finished, and the filter
    said yes: the first k of them), ``rejected`` (finished, but the filter said no), ``surplus``
    (finished after k were accepted: the abort came too late for them), ``aborted`` (aborted once
    k were accepted, before they finished) or ``failed`` (status error or expired)."""

    accepted: list[CompletionRecord] = field(default_factory=list)
    rejected: list[CompletionRecord] = field(default_factory=list)
    surplus: list[CompletionRecord] = field(default_factory=list)
    aborted: list[CompletionRecord] = field(default_factory=list)
    failed: list[CompletionRecord] = field(default_factory=list)

    @property
    def members(self) -> int:
        return self.total


class RolloutGroup:
    """The n member requests of one prompt, as submitted by :meth:`Producer.submit_group`."""

    def __init__(self, producer: Aborter, group_id: str, futures: dict[str, asyncio.Future]):
        self.producer = producer
        self.group_id = group_id
        self.futures = futures

    @property
    def request_ids(self) -> list[str]:
        return list(self.futures)

    async def stream(self) -> AsyncIterator[CompletionRecord]:
        """Members' records as they finish."""
        for fut in asyncio.as_completed(list(self.futures.values())):
            yield await fut

    async def wait(self, timeout: float | None = None) -> list[CompletionRecord]:
        """Every member's record, in member order."""
        return list(await asyncio.wait_for(asyncio.gather(*self.futures.values()), timeout))

    async def abort(self) -> None:
        """Abort the members that have no record yet."""
        pending = [rid for rid, fut in self.futures.items() if not fut.done()]
        if pending:
            await self.producer.abort(pending)

    async def take(self, k: int, accept: Callable[[CompletionRecord], bool] = lambda r: True,
                   timeout: float | None = None) -> GroupOutcome:
        """Accept the first ``k`` finished members that pass ``accept``, abort the rest, and
        report every member."""
        outcome = GroupOutcome()
        remaining = dict(self.futures)

        async def consume() -> None:
            for fut in asyncio.as_completed(list(remaining.values())):
                rec = await fut
                remaining.pop(rec.request_id, None)
                if len(outcome.accepted) >= k:
                    _file(outcome, rec, surplus=True)
                    continue
                if rec.status is RecordStatus.FINISHED:
                    (outcome.accepted if accept(rec) else outcome.rejected).append(rec)
                    if len(outcome.accepted) >= k and remaining:
                        await self.producer.abort(list(remaining))
                else:
                    _file(outcome, rec, surplus=False)

        await asyncio.wait_for(consume(), timeout)
        return outcome


def _file(outcome: GroupOutcome, rec: CompletionRecord, *, surplus: bool) -> None:
    if rec.status is RecordStatus.FINISHED:
        (outcome.surplus if surplus else outcome.rejected).append(rec)
    elif rec.status is RecordStatus.ABORTED:
        outcome.aborted.append(rec)
    else:
        outcome.failed.append(rec)


def group_members(group_id: str, n: int, base: dict[str, Any]) -> list[dict[str, Any]]:
    """The n single-sample member requests of a group (seeds offset per member when seeded)."""
    sp = dict(base.pop("sampling_params", None) or {})
    sp.pop("n", None)
    seed = sp.get("sampling_seed")
    members = []
    for i in range(n):
        member_sp = dict(sp)
        if seed is not None:
            member_sp["sampling_seed"] = seed + i
        meta = dict(base.get("meta_info") or {})
        meta.update(group_index=i, group_size=n)
        members.append({**base, "request_id": f"{group_id}_{i:03d}", "group_id": group_id,
                        "sampling_params": member_sp, "meta_info": meta})
    return members


# ---------------------------------------------------------------- partial rollouts


def next_segment(original: GenerationRequest, so_far: list[int], segment: int) -> GenerationRequest | None:
    """The segment that continues ``original`` after ``so_far`` output tokens, or None when its
    budget is spent: prompt + tokens so far, the budget shrunk by as much (see
    :func:`~redroll.shared.continuing.continue_after`), the same ``sampling_seed``, and its own
    request_id, ``<request_id>~<segment>``."""
    if original.input_ids is None:
        raise ValueError("segments continue from token ids: submit the request with input_ids")
    if original.sampling_params.max_new_tokens - len(so_far) <= 0:
        return None
    meta = dict(original.meta_info)
    meta.update(continues=original.request_id, segment=segment)
    return continue_after(original, so_far, request_id=f"{original.request_id}~{segment}", meta_info=meta,
                          collect_unfinished=True, reply_to=None)


def stitch_segments(request_id: str, segments: list[CompletionRecord]) -> CompletionRecord:
    """One record from the segments of a sample that ran in parts (joined as
    :func:`~redroll.shared.continuing.join_parts` says): ids and logprobs end to end, the last
    segment's status and finish reason, ``meta_info["segments"]`` (which worker and version made
    which part) and the record's per-token ``weight_versions``."""
    if not segments:
        raise ValueError("no segments to stitch")
    for seg in segments:
        if len(seg.output_token_ids) != 1:
            raise ValueError("segmented generation is single-sample (use groups for n > 1)")
    joined = join_parts((seg.output_token_ids[0], seg.output_logprobs[0] if seg.output_logprobs is not None else None,
                         seg.token_versions(0)) for seg in segments)
    parts = [{"request_id": seg.request_id, "tokens": len(seg.output_token_ids[0]),
              "weight_version": seg.meta_info.get("weight_version"),
              "finish_reason": seg.finish_reasons[0], "worker": seg.worker} for seg in segments]
    last = segments[-1]
    meta = dict(last.meta_info)
    meta.update(segments=parts, completion_tokens=len(joined.token_ids),
                prompt_tokens=segments[0].meta_info.get("prompt_tokens"))
    meta.pop("continues", None)
    meta.pop("segment", None)
    return CompletionRecord(request_id=request_id, status=last.status, output_token_ids=[joined.token_ids],
                            finish_reasons=list(last.finish_reasons),
                            output_logprobs=[joined.logprobs] if joined.logprobs is not None else None,
                            meta_info=meta, error=last.error, worker=last.worker, callback=last.callback,
                            group_id=last.group_id,
                            weight_versions=[joined.weight_versions] if joined.weight_versions else None,
                            prompt_token_ids=segments[0].prompt_token_ids)


# ---------------------------------------------------------------- staleness


def staleness_report(records: Iterable[CompletionRecord], current_version: int) -> dict[str, Any]:
    """How many versions behind ``current_version`` a batch's samples were generated (per token
    for stitched partial rollouts: their oldest segment counts)."""
    lags = []
    for rec in records:
        versions = [v for i in range(len(rec.output_token_ids)) for v in rec.token_versions(i)] or [
            rec.meta_info.get("weight_version")]
        numeric = [int(v) for v in versions if v is not None and str(v).lstrip("-").isdigit()]
        if numeric:
            lags.append(current_version - min(numeric))
    if not lags:
        return {"samples": 0}
    histogram: dict[str, int] = {}
    for lag in lags:
        histogram[str(lag)] = histogram.get(str(lag), 0) + 1
    return {"samples": len(lags), "max": max(lags), "min": min(lags), "mean": statistics.fmean(lags),
            "histogram": dict(sorted(histogram.items(), key=lambda kv: int(kv[0])))}
