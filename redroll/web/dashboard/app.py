"""The web dashboard's application: ``redroll dashboard`` (``redroll[dashboard]``: Starlette on uvicorn).

Every figure comes from Redis alone, as ``redroll status`` reads it: ``GET /api/status`` returns
exactly the document of ``redroll status --json`` (:func:`redroll.ops.status.collect_pipeline_status`),
and the page (:mod:`redroll.web.dashboard.page`) polls it. Reads run with the rights of the connection
it is given (the ``operator`` ACL role is enough). The two actions that change state, requeue and
purge dead letters, are off unless the dashboard is started with an administrator connection and a
bearer token (:class:`Actions`): without them they answer 403, with them a request without the token
answers 401.

Routes:
    GET  /                     the page
    GET  /api/status           the status document (``redroll status --json``)
    GET  /api/weights          the desired weights (``{ns}:weights``; ``null`` until one is set)
    GET  /api/dead             dead letters, oldest first (``redroll dead list --json``'s entries)
    GET  /api/request/{id}     one request's timeline (``redroll trace --json``'s document, and its
                               ``steps`` in time order), from :mod:`redroll.ops.trace`
    POST /api/dead/requeue     ``{"ids": [...]}``: re-validate and requeue (administrator, token)
    POST /api/dead/purge       ``{"ids": [...]}``: delete (administrator, token)
    GET  /metrics              the pipeline exporter's figures (:mod:`redroll.observability.exporter`; needs
                               ``redroll[metrics]``)
"""

from __future__ import annotations

import importlib
import secrets
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import redis
from redis.asyncio import Redis

from redroll.ops import dead
from redroll.ops.status import collect_pipeline_status
from redroll.shared.settings import Settings
from redroll.shared.streams import text
from redroll.web.dashboard.page import render_page

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
"""The Host headers a dashboard bound to a loopback address answers (a page of another site that
resolves its own name to 127.0.0.1 cannot read it: DNS rebinding)."""

MAX_DEAD_SHOWN = 200
"""Dead letters ``/api/dead`` lists at most, oldest first (per partition; each is read with its
request): the count in the status is the full one, and ``redroll dead list`` shows them all."""


MAX_IDS_PER_ACTION = 1000

EntryId = Annotated[str, msgspec.Meta(pattern=r"^[0-9]+-[0-9]+$")]
"""A stream entry id, ``MS-SEQ`` (as ``/api/dead`` lists them)."""


class DeadLetterIds(msgspec.Struct, forbid_unknown_fields=True):
    """The body of the two dead-letter actions."""

    ids: Annotated[list[EntryId], msgspec.Meta(max_length=MAX_IDS_PER_ACTION)]


@dataclass
class Actions:
    """What the actions that change state need: an administrator connection and the bearer token."""

    redis: Redis
    settings: Settings
    token: str

    def authorized(self, header: str | None) -> bool:
        scheme, _, given = (header or "").partition(" ")
        return scheme.lower() == "bearer" and bool(given) and secrets.compare_digest(given.strip().encode(),
                                                                                     self.token.encode())


def _error(status_code: int, message: str, **headers: str) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse({"error": message}, status_code=status_code, headers=headers or None)


def create_app(r: Redis, settings: Settings, *, actions: Actions | None = None, interval_s: float = 1.0,
               allowed_hosts: list[str] | None = None) -> Any:
    """The Starlette application. ``r`` reads (operator rights suffice); ``actions`` enables requeue
    and purge; ``allowed_hosts`` limits the Host headers answered (None: any)."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.trustedhost import TrustedHostMiddleware
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, Response
    from starlette.routing import Route

    keys, parts = settings.keys, settings.partition_keys
    page = render_page(namespace=settings.namespace, actions=actions is not None, interval_ms=int(interval_s * 1000))

    async def index(request: Request) -> Response:
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    async def status(request: Request) -> Response:
        return JSONResponse(await collect_pipeline_status(r, keys, parts))

    async def weights(request: Request) -> Response:
        desired = {text(k): text(v) for k, v in (await r.hgetall(keys.weights)).items()}
        return JSONResponse({"desired": desired or None})

    async def dead_letters(request: Request) -> Response:
        entries = [e.to_json() for part in parts for e in await dead.list_dead(r, part, count=MAX_DEAD_SHOWN)]
        return JSONResponse({"entries": entries, "actions": actions is not None})

    async def request_timeline(request: Request) -> Response:
        return await _timeline(r, settings, request.path_params["request_id"])

    async def act(request: Request, action: str) -> Response:
        if actions is None:
            return _error(403, "actions are disabled: start redroll dashboard with --allow-actions, administrator "
                               "credentials and --token-file to requeue or purge from the page")
        if not actions.authorized(request.headers.get("authorization")):
            return _error(401, "this action needs the dashboard's bearer token (Authorization: Bearer TOKEN)",
                          **{"WWW-Authenticate": "Bearer"})
        try:
            body = msgspec.json.decode(await request.body(), type=DeadLetterIds)
        except msgspec.DecodeError as exc:
            return _error(400, f"the body must be {{\"ids\": [dead-letter entry ids]}}: {exc}")
        if not body.ids:
            return _error(400, "ids: name at least one dead-letter entry id")
        if action == "requeue":
            done, refused = await dead.requeue(actions.redis, actions.settings, body.ids)
            return JSONResponse({"requeued": done, "refused": refused})
        purged = 0
        for part in actions.settings.partition_keys:
            purged += await dead.purge(actions.redis, part, body.ids)
        return JSONResponse({"purged": purged})

    async def requeue(request: Request) -> Response:
        return await act(request, "requeue")

    async def purge(request: Request) -> Response:
        return await act(request, "purge")

    async def metrics(request: Request) -> Response:
        try:
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            from redroll.observability.exporter import PipelineMetrics
        except ImportError:
            return _error(501, "/metrics needs prometheus-client: pip install 'redroll[metrics]'")
        exporter = PipelineMetrics()
        await exporter.refresh(r, keys, parts)
        return Response(generate_latest(exporter.registry), media_type=CONTENT_TYPE_LATEST)

    async def redis_unavailable(request: Request, exc: Exception) -> Response:
        return _error(503, f"redis: {' '.join(str(exc).split())}")

    routes = [
        Route("/", index),
        Route("/api/status", status),
        Route("/api/weights", weights),
        Route("/api/dead", dead_letters),
        Route("/api/request/{request_id:path}", request_timeline),
        Route("/api/dead/requeue", requeue, methods=["POST"]),
        Route("/api/dead/purge", purge, methods=["POST"]),
        Route("/metrics", metrics),
    ]
    middleware = [Middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts)] if allowed_hosts else []
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={redis.RedisError: redis_unavailable, OSError: redis_unavailable})


async def _timeline(r: Redis, settings: Settings, request_id: str) -> Any:
    """One request's timeline (:func:`redroll.ops.trace.request_timeline`, what ``redroll trace
    --json`` prints) with its steps in time order (``steps``: the rows ``redroll trace`` draws),
    which the page shows. Imported on first use, so the page serves without it."""
    from starlette.responses import JSONResponse

    try:
        trace = importlib.import_module("redroll.ops.trace")
    except ImportError:
        return _error(501, "request lookup needs redroll.ops.trace (redroll trace REQUEST_ID), which this install lacks")
    if not request_id.strip():
        return _error(400, "request_id: name a request")
    timeline = await trace.request_timeline(r, settings.partition_keys, request_id,
                                            dedup_window_s=settings.dedup_window_s)
    body = timeline.to_builtins()
    body["steps"] = [{"at": at, "step": step, "what": what} for at, step, what in trace.timeline_rows(timeline)]
    return JSONResponse(body)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (the address the dashboard binds) is reachable from this machine only."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
