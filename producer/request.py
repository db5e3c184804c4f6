"""Requests as the producer builds them, and the stream each one is queued on."""

from __future__ import annotations

import uuid
from typing import Any, Mapping

from redroll.shared.codec import decode_sampling_params
from redroll.shared.keys import Keys, lane_index
from redroll.shared.types import GenerationRequest, SamplingParams


def make_request(
    *,
    request_id: str | None = None,
    prompt: str | None = None,
    input_ids: list[int] | None = None,
    sampling_params: SamplingParams | Mapping[str, Any] | None = None,
    **fields: Any,
) -> GenerationRequest:
    """Build a request from plain values; ``sampling_params`` may be a dict (validated here)."""
    if not isinstance(sampling_params, SamplingParams):
        sampling_params = decode_sampling_params(dict(sampling_params or {}))
    return GenerationRequest(
        request_id=request_id or uuid.uuid4().hex,
        prompt=prompt,
        input_ids=list(input_ids) if input_ids is not None else None,
        sampling_params=sampling_params,
        **fields,
    )


def request_stream(keys: Keys, request: GenerationRequest) -> str:
    """The stream a request is queued on: high priority has its own, claimed first; with affinity
    lanes, a request with an affinity key (or a group) queues on its lane; the rest on the shared one."""
    if request.priority:
        return keys.requests_high
    if keys.lanes and request.lane_key:
        return keys.lane(lane_index(request.lane_key, keys.lanes))
    return keys.requests
