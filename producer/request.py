"""Requests as the producer builds them, and the stream each one is queued on."""

from __future__ import annotations

import uuid
from typing import Any, Mapping, Sequence

from redroll.shared.codec import decode_messages, decode_sampling_params
from redroll.shared.keys import Keys, lane_index
from redroll.shared.types import ChatMessage, GenerationRequest, SamplingParams


def make_request(
    *,
    request_id: str | None = None,
    prompt: str | None = None,
    input_ids: list[int] | None = None,
    sampling_params: SamplingParams | Mapping[str, Any] | None = None,
    messages: Sequence[ChatMessage | Mapping[str, Any]] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    return_text: bool | None = None,
    **fields: Any,
) -> GenerationRequest:
    """Build a request from plain values; ``sampling_params`` may be a dict (validated here), as may
    each of ``messages`` (``{"role": ..., "content": ...}``: a chat, rendered by the worker with
    the model's chat template). ``return_text``: records carry ``output_text`` (nil: on for
    ``prompt`` and ``messages``, off for ``input_ids``)."""
    if not isinstance(sampling_params, SamplingParams):
        sampling_params = decode_sampling_params(dict(sampling_params or {}))
    return GenerationRequest(
        request_id=request_id or uuid.uuid4().hex,
        prompt=prompt,
        input_ids=list(input_ids) if input_ids is not None else None,
        messages=decode_messages(messages) if messages is not None else None,
        tools=[dict(t) for t in tools] if tools is not None else None,
        return_text=return_text,
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
