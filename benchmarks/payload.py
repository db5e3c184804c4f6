"""The benchmark's request and record shapes (one place, so every section and peer agrees).

A request is ROLL-shaped: a 34-character request_id (32 hex digits, then ``_<step>``), a short prompt as
``input_ids`` (8 tokens by default), ``max_new_tokens`` 8, a callback name. Its msgpack ``data``
field is ~245 bytes in namespace ``bench``.
"""

from __future__ import annotations

import itertools
import os
import uuid
from typing import Iterator

from redroll.shared.types import GenerationRequest

INPUT_LEN = 8
MAX_NEW_TOKENS = 8


def input_ids(i: int, length: int = INPUT_LEN) -> list[int]:
    return [(1000 + 37 * (i + j)) % 32000 for j in range(length)]


_ID_SEQ = itertools.count()
_ID_PREFIX: dict[int, str] = {}


def request_id(step: int = 0) -> str:
    """A unique ROLL-shaped id: 32 hex digits (a random per-process prefix and a counter) and
    ``_<step>``. Same shape as ``uuid4().hex``, without one ``os.urandom`` call per request (which
    would be the benchmark's own cost, not the queue's)."""
    pid = os.getpid()
    prefix = _ID_PREFIX.get(pid)
    if prefix is None:
        prefix = _ID_PREFIX.setdefault(pid, uuid.uuid4().hex[:24])
    return f"{prefix}{next(_ID_SEQ):08x}_{step}"


def make_requests(count: int, *, input_len: int = INPUT_LEN, max_new_tokens: int = MAX_NEW_TOKENS, n: int = 1,
                  logprob: bool = False, callback: str | None = "h", start: int = 0) -> Iterator[GenerationRequest]:
    from redroll.producer.client import make_request
    from redroll.shared.codec import decode_sampling_params

    # one validated (frozen) SamplingParams shared by every request, as Producer.submit_many shares
    # it: validating the same map again per request would be the benchmark's own cost
    sp = decode_sampling_params({"max_new_tokens": max_new_tokens, **({"n": n} if n != 1 else {})})
    for i in range(start, start + count):
        yield make_request(request_id=request_id(i % 7), input_ids=input_ids(i, input_len), sampling_params=sp,
                           callback=callback, return_logprob=logprob)


def sample_request_fields(namespace: str, **kw) -> dict[str, bytes]:
    """Stream fields of one request as the producer writes them (``rid``, ``reply_to``, ``data``)."""
    from redroll.shared.codec import encode_request
    from redroll.shared.keys import Keys

    req = next(make_requests(1, **kw))
    req.reply_to = Keys(namespace).results
    return encode_request(req)


def sample_record_fields(namespace: str, **kw) -> dict[str, bytes]:
    """Stream fields of the record the stock synthetic engine publishes for such a request."""
    from redroll.engine_worker.engines.base import EngineOutput, SampleOutput
    from redroll.engine_worker.engines.synthetic import SyntheticEngine
    from redroll.engine_worker.records import build_record
    from redroll.shared.codec import encode_record
    from redroll.shared.keys import Keys
    from redroll.shared.types import RecordStatus

    req: GenerationRequest = next(make_requests(1, **kw))
    req.reply_to = Keys(namespace).results
    engine = SyntheticEngine()
    samples = []
    for i in range(req.n):
        ids, lps = engine.tokens_for(req, i)
        samples.append(SampleOutput(ids, lps if req.return_logprob else None, "length"))
    out = EngineOutput(samples=samples, prompt_tokens=len(req.input_ids or []), weight_version="0")
    rec = build_record(req, out, status=RecordStatus.FINISHED, worker="worker-benchhost-12345-abcdef",
                       info=engine.info, attempt=1, queue_ms=1.234, engine_ms=0.123)
    return encode_record(rec)
