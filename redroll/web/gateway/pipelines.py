"""Several models behind one gateway: one pipeline (a namespace, its own fleet) per model name.

A call names its ``model``; the gateway routes it to that model's pipeline, whose producer queues
its requests and reads their records. The first model listed is the policy: ``/v1/models`` lists it
first, calls that name no model go to it, and the fleet-control endpoints act on its fleet. A call
naming a model that is not served is a 404, unless a default model is set: then it goes there
(clients that send their own config name, a checkpoint path, say).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from redroll.producer.client import Producer
from redroll.shared.settings import Settings
from redroll.web.gateway.idempotency import GatewayKeyedCalls
from redroll.web.gateway.protocol import GatewayError

HEARTBEAT_FRESH_S = 10.0
"""A worker whose heartbeat is older than this is not counted (it is gone)."""


@dataclass
class Pipeline:
    """One model's pipeline: its settings (namespace), producer and keyed calls."""

    name: str
    settings: Settings
    producer: Producer
    keyed: GatewayKeyedCalls | None = None
    queued: int = 0
    """Its queued and in-flight requests at the last health ping (with ``--max-queued``)."""
    max_model_len: int | None = field(default=None, init=False)
    _len_read_at: float = field(default=0.0, init=False)

    async def context_length(self, refresh_s: float = 2.0) -> int | None:
        """The model's context length: the smallest ``max_context`` among its live workers'
        heartbeats (None while no live worker says); read at most every ``refresh_s``."""
        now = time.monotonic()
        if now - self._len_read_at < refresh_s:
            return self.max_model_len
        self._len_read_at = now
        lengths = []
        for raw in (await self.producer.redis.hgetall(self.settings.keys.workers)).values():
            try:
                beat = json.loads(raw)
            except ValueError:
                continue
            if time.time() - float(beat.get("seen", 0)) <= HEARTBEAT_FRESH_S and beat.get("max_context"):
                lengths.append(int(beat["max_context"]))
        self.max_model_len = min(lengths) if lengths else None
        return self.max_model_len


def model_namespaces(settings: Settings, model_name: str) -> dict[str, str]:
    """Model name → namespace: ``settings.models`` when set, else ``model_name`` on the settings'
    own namespace."""
    return settings.model_namespaces or {model_name: settings.namespace}


class Pipelines:
    """The gateway's pipelines by model name, the policy first."""

    def __init__(self, settings: Settings, models: Mapping[str, str], default_model: str | None = None):
        if not models:
            raise ValueError("a gateway serves at least one model")
        if default_model is not None and default_model not in models:
            raise ValueError(f"--default-model {default_model!r} is not among the served models "
                             f"({', '.join(models)})")
        self.by_name: dict[str, Pipeline] = {}
        for name, namespace in models.items():
            scoped = settings.with_(namespace=namespace)
            self.by_name[name] = Pipeline(name, scoped, Producer(scoped, name=None))
        self.policy = next(iter(self.by_name.values()))
        self.default = self.by_name[default_model] if default_model is not None else None

    def __iter__(self):
        return iter(self.by_name.values())

    def route(self, model: str | None) -> Pipeline:
        """The pipeline a call naming ``model`` goes to, or 404."""
        if model is None:
            return self.policy
        found = self.by_name.get(model) or self.default
        if found is None:
            served = ", ".join(repr(n) for n in self.by_name)
            raise GatewayError(404, f"the model {model!r} does not exist here (this gateway serves {served})",
                               param="model", code="model_not_found")
        return found

    async def cards(self) -> list[dict[str, Any]]:
        """``/v1/models``: one card per model, the policy first, with ``max_model_len`` when its
        workers say it."""
        out = []
        for p in self:
            card: dict[str, Any] = {"id": p.name, "object": "model", "created": 0, "owned_by": "redroll",
                                    "root": p.name, "parent": None}
            length = await p.context_length()
            if length is not None:
                card["max_model_len"] = length
            out.append(card)
        return out


__all__ = ["Pipeline", "Pipelines", "model_namespaces"]
