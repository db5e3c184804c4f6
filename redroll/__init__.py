"""redroll: a queue-driven LLM generation pipeline on Redis Streams.

The public API in one place::

    from redroll import Producer, Settings
    async with Producer(Settings.from_env()) as p:
        record = await (await p.submit(prompt="Hello", sampling_params={"max_new_tokens": 16}))
"""

from consumer import ConsumerRunner
from engine_worker.worker import Worker
from producer import DuplicateRequestError, Producer, SyncProducer, make_request, send
from shared import (
    CompletionRecord,
    GenerationRequest,
    Keys,
    RecordStatus,
    SamplingParams,
    Settings,
    ValidationError,
)

__version__ = "0.1.0"

__all__ = [
    "CompletionRecord",
    "ConsumerRunner",
    "DuplicateRequestError",
    "GenerationRequest",
    "Keys",
    "Producer",
    "RecordStatus",
    "SamplingParams",
    "Settings",
    "SyncProducer",
    "ValidationError",
    "Worker",
    "make_request",
    "send",
]
