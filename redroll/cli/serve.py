"""``redroll serve``: the OpenAI-compatible gateway (``redroll.web.gateway``) on uvicorn."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from redroll.cli.options import (
    BIND_HELP,
    LOCALHOST,
    add_connection_options,
    listening_socket,
    positive_int,
    positive_seconds,
    settings_from_args,
)

log = logging.getLogger("redroll.web.gateway")


KEEP_ALIVE_S = 75
"""Idle keep-alive connections are closed after this: longer than load balancers' idle timeouts
(60 s by default on most), so a balancer never reuses a connection the gateway is closing."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve OpenAI's completions and chat API over the pipeline (a producer)")
    add_connection_options(p)
    p.add_argument("--host", default=LOCALHOST, help=BIND_HELP)
    p.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port)")
    p.add_argument("--model-name", default="redroll", help="the model name /v1/models lists and calls must name "
                                                             "(one pipeline, --namespace)")
    p.add_argument("--model", action="append", default=None, metavar="NAME=NAMESPACE",
                   help="serve several models, one pipeline (namespace, fleet) each; repeat it, the policy first "
                        "(it is listed first, takes calls that name no model, and fleet control acts on it); "
                        "env REDROLL_MODELS='policy=rl,judge=rl-judge'")
    p.add_argument("--default-model", default=None,
                   help="where calls naming a model that is not served go (default: a 404)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="take a chat call's chat_template (a Jinja template the worker renders, in Jinja's "
                        "sandbox); without it such a call is refused, as vLLM's server does")
    p.add_argument("--api-key-file", default=None,
                   help="a file of bearer keys, one a line ('#' comments); without it the gateway is open")
    p.add_argument("--max-backlog", type=positive_int, default=1024,
                   help="calls this gateway may have waiting for records or streaming; more get 429 with "
                        "Retry-After (it also sizes the pool of connections that wait: one per streamed choice)")
    p.add_argument("--max-queued", type=positive_int, default=None,
                   help="requests the whole pipeline may have queued or in flight (sampled every second); "
                        "more: new calls get 429 with Retry-After (default: no bound)")
    p.add_argument("--idempotency-window", type=positive_int, default=86_400,
                   help="seconds a call made with an Idempotency-Key keeps its completion for retries")
    p.add_argument("--session-window", type=positive_int, default=3600, metavar="SECONDS",
                   help="seconds a session (X-Session-Id, session_id) keeps its conversation's token ids after "
                        "its last turn: a chat that extends the session's messages then runs on exactly those "
                        "ids + the new messages' (default: 3600)")
    p.add_argument("--request-timeout", type=positive_seconds, default=600.0,
                   help="seconds a call waits for its records before a 504 (a stream that began ends with a "
                        "504 error event instead; the requests go on)")
    p.set_defaults(run=run)


def read_api_keys(path: str | None) -> frozenset[str]:
    """The bearer keys of ``path`` (one a line; blank lines and '#' comments skipped)."""
    if path is None:
        return frozenset()
    keys = {line.strip() for line in Path(path).read_text().splitlines()}
    keys = {k for k in keys if k and not k.startswith("#")}
    if not keys:
        raise ValueError(f"--api-key-file {path}: holds no key")
    return frozenset(keys)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from redroll.web.gateway.app import GatewayConfig, build_app
    except ImportError as exc:
        raise ImportError(f"redroll serve needs the serve extra (pip install 'redroll[serve]'): {exc}") from None
    settings = settings_from_args(args)
    if args.model:
        settings = settings.with_(models=",".join(args.model))
    keys = read_api_keys(args.api_key_file)
    host = args.host
    if not keys and host not in (LOCALHOST, "localhost", "::1"):
        log.warning("serving on %s with no --api-key-file: anyone who reaches it may generate", host)
    config = GatewayConfig(model_name=args.model_name, api_keys=keys, max_backlog=args.max_backlog,
                           max_queued=args.max_queued, default_model=args.default_model,
                           trust_request_chat_template=args.trust_request_chat_template,
                           idempotency_window_s=args.idempotency_window, request_timeout_s=args.request_timeout,
                           session_window_s=args.session_window)
    sock = listening_socket(host, args.port)  # (before anything starts: a port in use is one line)
    server = uvicorn.Server(uvicorn.Config(build_app(settings, config), log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=5, timeout_keep_alive=KEEP_ALIVE_S))
    server.run(sockets=[sock])
    return 0
