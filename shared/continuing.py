"""Continuing a generation after tokens it already made, and joining the parts into one output.

Two mechanisms run a single-sample, token-id request in parts, and share these rules:

* a ``resumable`` request (the request flag) survives a dead or drained worker: the worker that
  takes its entry again continues from the checkpoint (``engine_worker/checkpoints.py``);
* :meth:`Producer.generate_across_updates <redroll.producer.client.Producer.generate_across_updates>`
  survives a weight update that aborts requests in flight: the producer submits the rest as a new
  segment (``producer/rollout.py``).

The rules they agree on are here: the prompt grows by the tokens made so far, ``max_new_tokens``
and ``min_new_tokens`` shrink by as many, and the joined output is the parts' token ids, their
logprobs (none unless every part has them) and each token's weight version (none when one version
made every token). What differs stays with each: the seed (a resumed request continues with
``sampling_seed + tokens saved``, a segment keeps the request's seed), the request_id (a resumed
request keeps its own, a segment is ``<request_id>~<segment>``) and what the parts are read from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import msgspec

from redroll.shared.types import GenerationRequest


def continue_after(request: GenerationRequest, made: Sequence[int], *, seed: int | None = None,
                   **fields: Any) -> GenerationRequest:
    """``request`` continued after the output tokens ``made``: prompt + ``made``, with
    ``max_new_tokens`` and ``min_new_tokens`` (not below 0) shrunk by ``len(made)``. ``seed``: the
    continuation's ``sampling_seed`` (None keeps the request's); ``fields``: other request fields
    to replace. The caller checks that budget is left."""
    sp = request.sampling_params
    changes: dict[str, Any] = {"max_new_tokens": sp.max_new_tokens - len(made),
                               "min_new_tokens": max(0, sp.min_new_tokens - len(made))}
    if seed is not None:
        changes["sampling_seed"] = seed
    return msgspec.structs.replace(request, input_ids=list(request.input_ids or []) + list(made),
                                   sampling_params=msgspec.structs.replace(sp, **changes), **fields)


@dataclass
class JoinedOutput:
    """The parts of one sample, end to end."""

    token_ids: list[int]
    logprobs: list[float] | None
    """Every part's logprobs, or None when a part had none."""
    weight_versions: list[str] | None
    """Each token's weight version, or None when one version made them all."""


def join_parts(parts: Iterable[tuple[Sequence[int], Sequence[float] | None, Sequence[Any]]]) -> JoinedOutput:
    """Join ``(token_ids, logprobs or None, per-token weight versions)`` parts, in order."""
    token_ids: list[int] = []
    logprobs: list[float] | None = []
    versions: list[str] = []
    for ids, part_logprobs, part_versions in parts:
        token_ids += ids
        if logprobs is not None and part_logprobs is not None:
            logprobs += part_logprobs
        else:
            logprobs = None
        versions += [str(v) for v in part_versions]
    return JoinedOutput(token_ids, logprobs, versions if len(set(versions)) > 1 else None)
