"""Several models behind one object: one pipeline (a namespace, its own fleet) per model name.

RL runs serve more than the policy (a reference model, an LLM judge, a generative reward model),
each with its own workers. ``Settings.models`` (``REDROLL_MODELS='policy=rl,judge=rl-judge'``)
names them; a :class:`ModelRouter` holds one :class:`~redroll.producer.client.Producer` per model
and sends each request to the pipeline its ``model`` names::

    async with ModelRouter(settings) as models:                  # Settings.models, or models={...}
        rollout = await models.generate(prompt="2+2=", sampling_params={"max_new_tokens": 8})   # the policy
        verdict = await models.generate(model="judge", messages=[...])                           # its judge
        models.producer("judge")                                                                 # its Producer

The first model is the policy: a request that names no model goes there. The pipeline is the
model, so a routed request travels without its ``model`` field (a worker checks that field against
the model path it serves). ``redroll serve`` routes the same way, from the same setting.
"""

from __future__ import annotations

import asyncio
from typing import Any, Mapping, Sequence

import msgspec

from redroll.producer.client import Producer
from redroll.shared.errors import RedrollError
from redroll.shared.settings import Settings
from redroll.shared.types import CompletionRecord, GenerationRequest


class UnknownModelError(RedrollError, LookupError):
    """A request named a model that no pipeline of the router serves (and there is no default)."""


class ModelRouter:
    """One producer per model; requests routed by their ``model`` (the policy's when None)."""

    def __init__(self, settings: Settings | None = None, *, models: Mapping[str, str] | None = None,
                 default: str | None = None, **producer_options: Any):
        """``models``: model name → namespace, the policy first (default: ``settings.models``);
        ``default``: where a request naming a model not listed goes (default: refused with
        :class:`UnknownModelError`); ``producer_options``: for every :class:`Producer`."""
        settings = settings or Settings.from_env()
        namespaces = dict(models) if models is not None else settings.model_namespaces
        if not namespaces:
            raise ValueError("no models: set Settings.models (REDROLL_MODELS='policy=rl,judge=rl-judge') "
                             "or pass models={name: namespace}")
        if default is not None and default not in namespaces:
            raise ValueError(f"default {default!r} is not among the models ({', '.join(namespaces)})")
        self.namespaces = namespaces
        self.producers = {name: Producer(settings.with_(namespace=ns), **producer_options)
                          for name, ns in namespaces.items()}
        self.policy = next(iter(namespaces))
        """The first model: requests that name none go to it."""
        self.default = default

    @property
    def models(self) -> list[str]:
        """The model names, the policy first."""
        return list(self.producers)

    def producer(self, model: str | None = None) -> Producer:
        """The producer of ``model``'s pipeline (the policy's for None)."""
        if model is None:
            return self.producers[self.policy]
        found = self.producers.get(model)
        if found is None and self.default is not None:
            found = self.producers[self.default]
        if found is None:
            raise UnknownModelError(f"model {model!r} is not served here (the models are {', '.join(self.producers)})")
        return found

    async def start(self) -> "ModelRouter":
        started: list[Producer] = []
        try:
            for p in self.producers.values():
                await p.start()
                started.append(p)
        except BaseException:
            await asyncio.gather(*(p.close() for p in started), return_exceptions=True)
            raise
        return self

    async def close(self) -> None:
        await asyncio.gather(*(p.close() for p in self.producers.values()))

    async def __aenter__(self) -> "ModelRouter":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def _route(self, request: GenerationRequest | None, fields: dict[str, Any]
               ) -> tuple[Producer, GenerationRequest | None, dict[str, Any]]:
        if request is not None:
            return self.producer(request.model), msgspec.structs.replace(request, model=None), fields
        model = fields.pop("model", None)
        return self.producer(model), None, fields

    async def submit(self, request: GenerationRequest | None = None, **fields: Any) -> asyncio.Future:
        """:meth:`Producer.submit` on the pipeline of the request's ``model``."""
        producer, request, fields = self._route(request, dict(fields))
        return await producer.submit(request, **fields)

    async def generate(self, request: GenerationRequest | None = None, *, timeout: float | None = None,
                       **fields: Any) -> CompletionRecord:
        """:meth:`Producer.generate` on the pipeline of the request's ``model``."""
        producer, request, fields = self._route(request, dict(fields))
        return await producer.generate(request, timeout=timeout, **fields)

    async def submit_many(self, requests: Sequence[GenerationRequest], **options: Any) -> list[asyncio.Future]:
        """Each request on its model's pipeline (one :meth:`Producer.submit_many` per model);
        the futures in the order of ``requests``."""
        routed: dict[int, tuple[Producer, list[tuple[int, GenerationRequest]]]] = {}
        for i, req in enumerate(requests):  # (all checked before anything is sent)
            producer = self.producer(req.model)
            routed.setdefault(id(producer), (producer, []))[1].append((i, msgspec.structs.replace(req, model=None)))
        out: list[asyncio.Future | None] = [None] * len(requests)
        for producer, items in routed.values():
            futures = await producer.submit_many([req for _, req in items], **options)
            for (i, _), future in zip(items, futures):
                out[i] = future
        return out  # type: ignore[return-value]


__all__ = ["ModelRouter", "UnknownModelError"]
