"""The gateway's HTTP application (Starlette): OpenAI's endpoints over redroll pipelines.

One :class:`Gateway` per process, over one pipeline per model (:mod:`.pipelines`; one model unless
told otherwise): a call is routed by its ``model`` to a pipeline, whose producer submits it (calls
without an ``Idempotency-Key`` await their records on the producer's own reply stream; keyed calls
go through the producer's :class:`~redroll.producer.keyed.KeyedCalls`, whose records any replica can
read). A call is parse → requests → records → response; a streamed call (``stream: true``) is
parse → requests → chunks → events instead (:mod:`redroll.web.gateway.sse`). The fleet-control
endpoints are in :mod:`.fleet`, vLLM's token-in/token-out endpoint in :mod:`.generate`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

import msgspec
import redis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from redroll.producer.client import Producer
from redroll.shared.connection import connect
from redroll.shared.errors import ConnectionUnavailableError
from redroll.shared.settings import Settings
from redroll.shared.types import CompletionRecord, GenerationRequest, RecordStatus
from redroll.web.gateway.fleet import Fleet
from redroll.web.gateway.generate import generate
from redroll.web.gateway.idempotency import GatewayKeyedCalls, call_name, fingerprint
from redroll.web.gateway.pipelines import Pipeline, Pipelines, model_namespaces
from redroll.web.gateway.protocol import ChatBody, CompletionBody, GatewayError, decode_body, refuse_unsupported
from redroll.web.gateway.sessions import DEFAULT_WINDOW_S, Sessions, SessionTurn
from redroll.web.gateway.sse import EventStream, EventWriter, open_choices, respond
from redroll.web.gateway.translate import (
    META,
    assistant_message,
    build_requests,
    chat_response,
    completion_response,
    prompt_token_ids,
)

log = logging.getLogger("redroll.web.gateway")

UNREACHABLE = (ConnectionUnavailableError, redis.ConnectionError, redis.TimeoutError, OSError)
"""What a Redis that cannot be reached raises."""


@dataclass
class GatewayConfig:
    """What ``redroll serve`` was told (see its ``--help``)."""

    model_name: str = "redroll"
    """The model's name with one pipeline (``Settings.models`` unset)."""
    default_model: str | None = None
    """Where calls naming a model that is not served go (None: they get 404)."""
    api_keys: frozenset[str] = frozenset()
    """Bearer keys; empty: the gateway is open (and binds to localhost unless told otherwise)."""
    max_backlog: int = 1024
    """Calls this gateway may have waiting for records; over it, 429 with ``Retry-After``."""
    max_queued: int | None = None
    """Requests the pipeline may have queued or in flight (all request streams, sampled with the
    health ping); over it, 429 with ``Retry-After``. None: no bound."""
    idempotency_window_s: int = 86_400
    request_timeout_s: float = 600.0
    health_interval_s: float = 1.0
    control_timeout_s: float = 600.0
    """How long a fleet-control call (pause, update_weights, resume) waits for the workers."""
    trust_request_chat_template: bool = False
    """Take a call's ``chat_template`` (code the worker runs, in Jinja's sandbox); refused otherwise."""
    session_window_s: int = DEFAULT_WINDOW_S
    """How long a session's token ids are kept after its last turn (see :mod:`.sessions`)."""


class Metrics:
    """The gateway's Prometheus series, on a registry of its own (no global state)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("redroll_gateway_requests", "HTTP calls by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.latency = Histogram("redroll_gateway_request_seconds", "HTTP call latency by endpoint", ["endpoint"],
                                 registry=self.registry)
        self.waiting = Gauge("redroll_gateway_waiting_calls", "calls waiting for their records", registry=self.registry)
        self.redis_up = Gauge("redroll_gateway_redis_up", "1 while Redis answers the health ping",
                              registry=self.registry)
        self.queued = Gauge("redroll_gateway_pipeline_queued", "the pipeline's queued and in-flight requests "
                            "(with --max-queued)", registry=self.registry)
        self.tokens = Counter("redroll_gateway_completion_tokens", "tokens returned", registry=self.registry)


class Gateway:
    """The state of one gateway process: its pipelines (a producer and keyed calls each), metrics
    and Redis health."""

    def __init__(self, settings: Settings, config: GatewayConfig):
        self.settings = settings
        self.config = config
        self.pipelines = Pipelines(settings, model_namespaces(settings, config.model_name), config.default_model)
        self.metrics = Metrics()
        self.redis_ok = False
        self.waiting = 0
        self._started_producers: set[str] = set()
        self._wait_client: Any = None
        self._health: asyncio.Task | None = None

    @property
    def producer(self) -> Producer:
        """The policy's producer."""
        return self.pipelines.policy.producer

    @property
    def keyed(self) -> GatewayKeyedCalls | None:
        """The policy's keyed calls."""
        return self.pipelines.policy.keyed

    @property
    def queued(self) -> int:
        """The pipelines' queued and in-flight requests at the last health ping."""
        return sum(p.queued for p in self.pipelines)

    async def _start_producers(self) -> None:
        for p in self.pipelines:
            if p.name not in self._started_producers:
                await p.producer.start()
                self._started_producers.add(p.name)

    async def start(self) -> None:
        """Start the producers, then watch Redis's health. While Redis is unreachable the producers
        are started again every ``health_interval_s`` and calls get 503; any other error (a bad
        setting, lanes that disagree) ends the start."""
        try:
            await self._start_producers()
        except UNREACHABLE as exc:
            log.warning("%s: calls get 503 until Redis answers", exc)
            self._health = asyncio.create_task(self._start_then_watch(), name="gateway-health")
            return
        self._started()
        self._health = asyncio.create_task(self._watch_health(), name="gateway-health")

    def _started(self) -> None:
        self._wait_client = connect(self.settings, max_connections=self.config.max_backlog + 1)
        for p in self.pipelines:
            p.keyed = GatewayKeyedCalls(p.producer.keyed_calls(self._wait_client, self.config.idempotency_window_s))
        self.redis_ok = True
        self.metrics.redis_up.set(1)

    async def close(self) -> None:
        if self._health is not None:
            self._health.cancel()
            await asyncio.gather(self._health, return_exceptions=True)
        for p in self.pipelines:
            await p.producer.close()
        if self._wait_client is not None:
            await self._wait_client.aclose()

    async def _start_then_watch(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self._start_producers()
                break
            except UNREACHABLE:
                continue
        log.warning("Redis is reachable: serving")
        self._started()
        await self._watch_health()

    async def _watch_health(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._ping(), self.config.health_interval_s * 2)
                ok = True
            except (redis.RedisError, OSError, asyncio.TimeoutError):
                ok = False
            if ok != self.redis_ok:
                log.warning("Redis is %s", "reachable again" if ok else "unreachable: calls get 503")
            self.redis_ok = ok
            self.metrics.redis_up.set(int(ok))
            await asyncio.sleep(self.config.health_interval_s)

    async def _ping(self) -> None:
        """PING, and with ``max_queued`` the length of every request stream of each pipeline
        (processed entries are deleted, so a stream's length is what is queued or in flight on it)."""
        if self.config.max_queued is None:
            await self.producer.redis.ping()
            return
        for p in self.pipelines:
            async with p.producer.redis.pipeline(transaction=False) as pipe:
                for part in p.settings.partition_keys:
                    for stream in part.request_streams:
                        pipe.xlen(stream)
                p.queued = sum(await pipe.execute())
        self.metrics.queued.set(self.queued)

    # ------------------------------------------------------------------ calls

    def authorize(self, request: Request) -> str:
        """The caller's scope (a hash of its key; "" when the gateway is open), or 401."""
        if not self.config.api_keys:
            return ""
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise GatewayError(401, "missing API key: send 'Authorization: Bearer <key>'", kind="authentication_error",
                               code="missing_api_key")
        if not any(hmac.compare_digest(token.strip().encode(), key.encode()) for key in self.config.api_keys):
            raise GatewayError(401, "incorrect API key", kind="authentication_error", code="invalid_api_key")
        return hashlib.sha256(token.strip().encode()).hexdigest()[:16]

    def authorize_control(self, request: Request) -> str:
        """As :meth:`authorize`, for fleet control, which an open gateway (no keys) refuses (403)."""
        if not self.config.api_keys:
            raise GatewayError(403, "fleet control (pause, update_weights, resume) needs the gateway's API keys: start "
                                    "redroll serve with --api-key-file FILE and send 'Authorization: Bearer <key>'",
                               kind="permission_error", code="keys_required")
        return self.authorize(request)

    def admit(self, pipeline: Pipeline | None = None) -> None:
        pipeline = pipeline or self.pipelines.policy
        if not self.redis_ok:
            raise GatewayError(503, "Redis is unreachable; retry later", kind="server_error", code="unavailable",
                               headers={"Retry-After": "1"})
        if self.waiting >= self.config.max_backlog:
            raise GatewayError(429, f"this gateway has {self.waiting} calls waiting (the bound is "
                                    f"{self.config.max_backlog}); retry later", kind="rate_limit_error",
                               code="backlog_full", headers={"Retry-After": "1"})
        if self.config.max_queued is not None and pipeline.queued >= self.config.max_queued:
            raise GatewayError(429, f"the pipeline has {pipeline.queued} requests queued or in flight (the bound is "
                                    f"{self.config.max_queued}); retry later", kind="rate_limit_error",
                               code="queue_full", headers={"Retry-After": "1"})

    async def records(self, requests: list[GenerationRequest], keyed_name: str | None,
                      body_fingerprint: str, pipeline: Pipeline | None = None) -> list[CompletionRecord]:
        """The records of a call's requests, in order (on ``pipeline``: the policy's by default)."""
        pipeline = pipeline or self.pipelines.policy
        timeout = self.config.request_timeout_s
        if keyed_name is not None:
            assert pipeline.keyed is not None
            return await pipeline.keyed.run(requests, keyed_name, timeout, body_fingerprint)
        futures = await pipeline.producer.submit_many(requests, validated=True)  # (build_requests checked them)
        try:
            return list(await asyncio.wait_for(asyncio.gather(*futures), timeout))
        except asyncio.TimeoutError:
            raise GatewayError(504, f"no record within {timeout:.0f} s (send an Idempotency-Key to be able to "
                                    "retry a call without running it twice)", kind="timeout", code="timeout") from None

    async def call(self, request: Request, kind: type[CompletionBody] | type[ChatBody]) -> dict[str, Any] | Response:
        """A call's response: a JSON object, or (``stream: true``) a stream of events."""
        scope = self.authorize(request)
        raw = await request.body()
        body = decode_body(raw, kind)
        refuse_unsupported(body, trust_chat_template=self.config.trust_request_chat_template)
        pipeline = self.pipelines.route(body.model)
        self.admit(pipeline)
        key = request.headers.get("idempotency-key")
        keyed_name = call_name(key, scope) if key else None
        call_id = keyed_name or f"g-{uuid.uuid4().hex}"
        session = request.headers.get("x-session-id") or body.session_id
        turn = await self.session_turn(pipeline, scope, session, body)
        fp = fingerprint(raw)
        requests = build_requests(body, base_id=call_id, session=session or body.user, settings=pipeline.settings,
                                  fingerprint=fp, model=body.model or pipeline.name, turn=turn)
        if body.stream:
            return await self.stream(body, call_id, requests, keyed_name, fp, pipeline, turn)
        self._waiting(+1)
        try:
            records = await self.records(requests, keyed_name, fp, pipeline)
        finally:
            self._waiting(-1)
        prompts = prompt_token_ids(body)
        if isinstance(body, ChatBody):
            response = chat_response(call_id, pipeline.name, records, prompts, body.top_logprobs or 0)
            await self.keep_session(pipeline, turn, records[0])
        else:
            response = completion_response(call_id, pipeline.name, records, prompts, body.logprobs or 0)
        self.metrics.tokens.inc(response["usage"]["completion_tokens"])
        return response

    async def session_turn(self, pipeline: Pipeline, scope: str, session: str | None,
                           body: CompletionBody | ChatBody) -> SessionTurn | None:
        """The session turn a chat with one choice and a session id makes (None for any other call:
        a session id then only keeps its calls on one worker)."""
        if not session or not isinstance(body, ChatBody) or body.n != 1:
            return None
        return await self.sessions(pipeline).begin(scope, session, body.messages)

    async def keep_session(self, pipeline: Pipeline, turn: SessionTurn | None, record: CompletionRecord | None) -> None:
        """Keep a session's turn once its record is finished (before the response goes out)."""
        if turn is None or record is None or record.status is not RecordStatus.FINISHED:
            return
        await self.sessions(pipeline).keep(turn, record, assistant_message(record, 0))

    def sessions(self, pipeline: Pipeline) -> Sessions:
        return Sessions(pipeline.producer.redis, pipeline.settings.keys, self.config.session_window_s)

    async def stream(self, body: CompletionBody | ChatBody, call_id: str, requests: list[GenerationRequest],
                     keyed_name: str | None, body_fingerprint: str, pipeline: Pipeline | None = None,
                     turn: SessionTurn | None = None) -> EventStream:
        """A streamed call's response, once its first chunk is here: a keyed call attaches to the
        requests of its key (submitting what was not), a call without a key submits them."""
        pipeline = pipeline or self.pipelines.policy
        assert pipeline.keyed is not None  # (admitted: Redis was reachable)
        wait_client = pipeline.keyed.wait_client
        self._waiting(+1)
        try:
            keyed = None
            if keyed_name is not None:  # (a keyed call's chunk stream is its own: read from its start)
                since = ["0-0"] * len(requests)
                keyed = await pipeline.keyed.start(requests, keyed_name, body_fingerprint)
                records: list[Any] = [keyed.record(req.request_id) for req in requests]
            else:  # (the gateway's chunk stream: read from where it is before the submit)
                since = await pipeline.producer.chunk_marks(requests, wait_client)
                records = await pipeline.producer.submit_many(requests, validated=True)  # (build_requests checked them)
            choices = open_choices(requests, records, wait_client, self.config.request_timeout_s, keyed, since)
        except BaseException:
            self._waiting(-1)
            raise
        created = requests[0].meta_info[META]["created"]
        writer = EventWriter(body, call_id, pipeline.name, created, prompt_token_ids(body))
        writer.with_ids = writer.with_ids or turn is not None  # (a session's every response has its ids)

        def ended(tokens: int) -> None:
            self._waiting(-1)
            self.metrics.tokens.inc(tokens)

        async def keep() -> None:
            await self.keep_session(pipeline, turn, writer.records.get(0))
        return await respond(writer, choices, ended, before_done=keep if turn is not None else None)

    def _waiting(self, change: int) -> None:
        self.waiting += change
        self.metrics.waiting.set(self.waiting)


class FastJSON(JSONResponse):
    """JSON encoded with msgspec (several times json.dumps's speed on long token lists)."""

    def render(self, content: Any) -> bytes:
        return msgspec.json.encode(content)


def _error(exc: GatewayError) -> JSONResponse:
    return FastJSON(exc.body(), status_code=exc.status, headers=exc.headers)


def build_app(settings: Settings, config: GatewayConfig) -> Starlette:
    """The ASGI application of one gateway process."""
    gateway = Gateway(settings, config)

    async def respond(request: Request, name: str, handler: Any) -> Response:
        """``handler(request)``'s answer (a JSON-able object or a Response), its errors in OpenAI's
        shape, counted and timed under ``name``."""
        started = time.perf_counter()
        try:
            answer = await handler(request)
            response: Response = answer if isinstance(answer, Response) else FastJSON(answer)
        except GatewayError as exc:
            response = _error(exc)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            log.warning("%s: Redis unreachable: %s", name, exc)
            response = _error(GatewayError(503, f"Redis is unreachable ({exc}); retry later", kind="server_error",
                                           code="unavailable", headers={"Retry-After": "1"}))
        except Exception as exc:  # (a bug: still answered in OpenAI's shape, and logged)
            log.exception("%s failed", name)
            response = _error(GatewayError(500, f"internal error: {exc}", kind="server_error", code="internal"))
        gateway.metrics.requests.labels(name, str(response.status_code)).inc()
        gateway.metrics.latency.labels(name).observe(time.perf_counter() - started)
        return response

    def endpoint(name: str, kind: type[CompletionBody] | type[ChatBody]):
        async def handle(request: Request) -> Response:
            return await respond(request, name, lambda req: gateway.call(req, kind))
        return handle

    async def inference_generate(request: Request) -> Response:
        return await respond(request, "inference.generate", lambda req: generate(gateway, req))

    async def models(request: Request) -> Response:
        try:
            gateway.authorize(request)
            cards = await gateway.pipelines.cards() if gateway.redis_ok else [
                {"id": p.name, "object": "model", "created": 0, "owned_by": "redroll", "root": p.name, "parent": None}
                for p in gateway.pipelines]
        except GatewayError as exc:
            return _error(exc)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            return _error(GatewayError(503, f"Redis is unreachable ({exc}); retry later", kind="server_error",
                                       code="unavailable", headers={"Retry-After": "1"}))
        return FastJSON({"object": "list", "data": cards})

    async def health(request: Request) -> Response:
        if not gateway.redis_ok:
            return JSONResponse({"status": "redis unreachable"}, status_code=503)
        return JSONResponse({"status": "ok", "waiting": gateway.waiting, "queued": gateway.queued})

    async def metrics(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        return _error(GatewayError(status, f"{request.method} {request.url.path}: no such endpoint",
                                   code="not_found" if status == 404 else "method_not_allowed"))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.close()

    app = Starlette(routes=[
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", endpoint("completions", CompletionBody), methods=["POST"]),
        Route("/v1/chat/completions", endpoint("chat.completions", ChatBody), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/inference/v1/generate", inference_generate, methods=["POST"]),
        *Fleet(gateway).routes(respond),
    ], lifespan=lifespan, exception_handlers={404: not_found, 405: not_found})
    app.state.gateway = gateway
    return app


__all__ = ["Gateway", "GatewayConfig", "build_app"]
