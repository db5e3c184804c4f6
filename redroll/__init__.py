"""redroll: a queue-driven LLM generation pipeline on Redis Streams.

The public API in one place::

    from redroll import Producer, Settings
    async with Producer(Settings.from_env()) as p:
        record = await (await p.submit(prompt="Hello", sampling_params={"max_new_tokens": 16}))

Installed, the repository's folders are one namespace: ``redroll.shared`` (the wire contract),
``redroll.producer``, ``redroll.engine_worker``, ``redroll.consumer``, beside this command-line
package. The names below are imported on first use, so ``import redroll.shared.codec`` loads
only the wire contract.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "CompletionRecord": "redroll.shared.types",
    "ConsumerRunner": "redroll.consumer.runner",
    "DuplicateRequestError": "redroll.shared.scripts",
    "GenerationRequest": "redroll.shared.types",
    "Keys": "redroll.shared.keys",
    "Producer": "redroll.producer.client",
    "RecordStatus": "redroll.shared.types",
    "SamplingParams": "redroll.shared.types",
    "Settings": "redroll.shared.settings",
    "SyncProducer": "redroll.producer.sync",
    "ValidationError": "redroll.shared.codec",
    "Worker": "redroll.engine_worker.worker",
    "make_request": "redroll.producer.client",
    "send": "redroll.producer.client",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'redroll' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
