"""One family for the errors redroll raises on purpose: ``except redroll.RedrollError`` catches them all.

Each keeps the built-in base it had before the family existed, so ``except ValueError`` (or
``RuntimeError``, ``ConnectionError``, ``redis.ResponseError``) still works too.

=============================  ==============================  ============================================
error                          also a                          raised when
=============================  ==============================  ============================================
``RedrollError``               ``Exception``                   (the root)
``ConnectionUnavailableError`` ``ConnectionError``             Redis cannot be reached (the message names
                                                               the URL; the cause is chained)
``RedisConfigError``           ``RuntimeError``                the Redis settings cannot work (bad URL,
                                                               unreadable password file)
``ValidationError``            ``ValueError``                  a request or record breaks the wire contract
``NewerSchemaError``           ``ValidationError``             an entry was written for a newer schema
``DuplicateRequestError``      ``RuntimeError``                a request_id is already queued or done
``StreamRefusedError``         ``redis.ResponseError``         Redis refused a write to a stream
``OwnershipError``             ``ValueError``                  a finish refused an entry that failed an
                                                               ownership check (it is dead-lettered)
``FunctionsMissingError``      ``redis.NoScriptError``         the server lacks redroll's function library
                                                               (reloaded by callers that may load it)
``FunctionsNotLoadedError``    ``redis.NoPermissionError``     the library is missing and this user may
                                                               not load it (``redroll functions load``)
``ReplicasBehindError``        ``redis.ConnectionError``       fewer replicas than ``wait_replicas`` confirmed
                                                               a write in time (it is sent again)
``LanesMismatchError``         ``RuntimeError``                a process's affinity lanes differ from the
                                                               pipeline's
``BeforeAckError``             ``RuntimeError``                a record was lost before the producer acked
``WeightSyncError``            ``RuntimeError``                a weight push to the workers failed
``WeightUpdateError``          ``RuntimeError``                an engine could not load new weights
``EngineCommandRefused``       ``RuntimeError``                an engine refused a command
``EngineRequestError``         ``RuntimeError``                an engine failed one request
``WeightsRefused``             ``ValueError``                  tensors do not fit the model
``RequeueRefused``             ``ValueError``                  a dead letter cannot be requeued
``ResumeError``                ``ValueError``                  ``redroll submit --resume`` cannot resume
``InputError``                 ``ValueError``                  ``redroll submit``'s input file is invalid
``JoinTimeout``                ``TimeoutError``                ``redroll.testing.Pipeline.join`` gave up
``UnknownModelError``          ``LookupError``                 a request named a model a ``ModelRouter``
                                                               does not serve
=============================  ==============================  ============================================

This module imports nothing from redroll (the modules that define the errors import
:class:`RedrollError` from here); the others are looked up where they are defined on first use,
as ``redroll.shared.errors.ValidationError`` or ``redroll.ValidationError``.
"""

from __future__ import annotations

import importlib
from typing import Any


class RedrollError(Exception):
    """The root of every error redroll raises on purpose."""


class ConnectionUnavailableError(RedrollError, ConnectionError):
    """Redis cannot be reached: the one-line message names the (redacted) URL; ``__cause__`` is the
    error of the Redis client."""


_DEFINED_IN = {
    "RedisConfigError": "redroll.shared.config_error",
    "ValidationError": "redroll.shared.codec",
    "NewerSchemaError": "redroll.shared.codec",
    "DuplicateRequestError": "redroll.shared.scripts",
    "OwnershipError": "redroll.shared.scripts",
    "FunctionsMissingError": "redroll.shared.functions",
    "FunctionsNotLoadedError": "redroll.shared.functions",
    "StreamRefusedError": "redroll.shared.refusals",
    "ReplicasBehindError": "redroll.shared.connection.durability",
    "LanesMismatchError": "redroll.shared.lanes",
    "BeforeAckError": "redroll.producer.replies",
    "WeightSyncError": "redroll.producer.weight_sync",
    "WeightUpdateError": "redroll.engine_worker.engines.sglang_weights",
    "EngineCommandRefused": "redroll.engine_worker.engines.sglang_weights",
    "EngineRequestError": "redroll.engine_worker.engines.sglang_output",
    "WeightsRefused": "redroll.engine_worker.engines.torch_weights",
    "RequeueRefused": "redroll.ops.dead",
    "ResumeError": "redroll.cli.batch_resume",
    "InputError": "redroll.cli.batch_run",
    "JoinTimeout": "redroll.testing",
    "UnknownModelError": "redroll.producer.models",
}
"""Where each error that is not defined here lives (imported on first use: no import cycle)."""

__all__ = sorted(["RedrollError", "ConnectionUnavailableError", *_DEFINED_IN])


def lazy_names(module_name: str, defined_in: dict[str, str], namespace: dict[str, Any]) -> tuple[Any, Any]:
    """A module's ``__getattr__`` and ``__dir__`` (PEP 562) for names imported on first use from
    where ``defined_in`` says they live (then kept in ``namespace``, the module's globals)."""

    def getattr_(name: str) -> Any:
        module = defined_in.get(name)
        if module is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted([*namespace, *defined_in])

    return getattr_, dir_


__getattr__, __dir__ = lazy_names(__name__, _DEFINED_IN, globals())
