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
``EngineError``                ``Exception``                   (the root of an engine's errors: what the
                                                               worker does with each, engine contract)
``EngineCommandRefused``       ``RuntimeError``                an engine refused a command
``EngineRequestError``         ``RuntimeError``                an engine failed one request
``EngineDeadError``            ``RuntimeError``                an engine can serve nothing any more
``WeightsRefused``             ``ValueError``                  tensors do not fit the model
``RequeueRefused``             ``ValueError``                  a dead letter cannot be requeued
``ResumeError``                ``ValueError``                  ``redroll submit --resume`` cannot resume
``InputError``                 ``ValueError``                  ``redroll submit``'s input file is invalid
``JoinTimeout``                ``TimeoutError``                ``redroll.testing.Pipeline.join`` gave up
``UnknownModelError``          ``LookupError``                 a request named a model a ``ModelRouter`` serves no
                                                               pipeline for
``RolloutError``               ``RuntimeError``                a trainer's rollout through redroll failed
                                                               (it names each request and why)
=============================  ==============================  ============================================

The root lives in :mod:`redroll.shared.errors` (the lowest layer: every package may raise); each
other error where it is raised. This module imports none of them: they are looked up where they are
defined on first use, as ``redroll.errors.ValidationError`` or ``redroll.ValidationError``.
"""

from __future__ import annotations

import importlib
from typing import Any

_DEFINED_IN = {
    "RedrollError": "redroll.shared.errors",
    "ConnectionUnavailableError": "redroll.shared.errors",
    "RedisConfigError": "redroll.shared.errors",
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
    "EngineError": "redroll.engine_worker.engines.base",
    "EngineRequestError": "redroll.engine_worker.engines.base",
    "EngineDeadError": "redroll.engine_worker.engines.base",
    "EngineCommandRefused": "redroll.engine_worker.engines.base",
    "WeightUpdateError": "redroll.engine_worker.engines.base",
    "WeightsRefused": "redroll.engine_worker.engines.base",
    "RequeueRefused": "redroll.ops.dead",
    "ResumeError": "redroll.cli.batch_resume",
    "InputError": "redroll.cli.batch_run",
    "JoinTimeout": "redroll.testing",
    "RolloutError": "redroll.integrations.trl",
    "UnknownModelError": "redroll.producer.models",
}
"""Where each error that is not defined here lives (imported on first use: no import cycle)."""

__all__ = sorted(_DEFINED_IN)


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
