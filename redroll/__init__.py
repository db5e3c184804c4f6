"""redroll: a queue-driven LLM generation pipeline on Redis Streams.

The public API in one place::

    from redroll import Producer, Settings
    async with Producer(Settings.from_env()) as p:
        record = await (await p.submit(prompt="Hello", sampling_params={"max_new_tokens": 16}))

Installed, the repository's folders are one namespace: ``redroll.shared`` (the wire contract),
``redroll.producer``, ``redroll.engine_worker``, ``redroll.consumer``, beside this command-line
package. The names below are imported on first use, so ``import redroll.shared.codec`` loads
only the wire contract.

Every error redroll raises on purpose is a :class:`RedrollError` (see :mod:`redroll.errors`), and
each is exported here.
"""

from __future__ import annotations

from redroll.errors import _DEFINED_IN as _ERRORS_DEFINED_IN
from redroll.errors import lazy_names

__version__ = "0.3.0"

_EXPORTS = {
    "CompletionRecord": "redroll.shared.types",
    "ConsumerRunner": "redroll.consumer.runner",
    "GenerationRequest": "redroll.shared.types",
    "Keys": "redroll.shared.keys",
    "Producer": "redroll.producer.client",
    "RecordStatus": "redroll.shared.types",
    "SamplingParams": "redroll.shared.types",
    "Settings": "redroll.shared.settings",
    "StreamChunk": "redroll.producer.stream_reader",
    "SyncProducer": "redroll.producer.sync",
    "Worker": "redroll.engine_worker.worker",
    "make_request": "redroll.producer.client",
    "send": "redroll.producer.client",
}

# Every error of the family (redroll.errors), each from where it is defined.
_EXPORTS.update(_ERRORS_DEFINED_IN)

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS, globals())
