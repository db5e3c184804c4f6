"""OpenTelemetry tracing, optional (the ``tracing`` extra: ``opentelemetry-api`` and ``-sdk``).

One trace per request: the producer's ``redroll.cli.batch_run`` span puts its W3C trace context in the
request (``traceparent``); each worker that runs the request (a resumed request: every one of
them) adds ``redroll.queue`` (submit to claim), ``redroll.engine`` (generation) and
``redroll.publish`` (the fenced finish) under it, and puts the publish span's context in the
record (``traceparent``), under which a consumer group's ``redroll.callback`` span runs.

Nothing here is configured by redroll: the process's tracer provider is the application's, or
what ``opentelemetry-instrument`` sets up from the standard ``OTEL_*`` environment variables. Until
one is set (or without the packages: then nothing is imported from them) :func:`tracer` is None
and every call here costs one attribute check.
"""

from __future__ import annotations

import time
from typing import Any, Optional

TRACER_NAME = "redroll"


def tracer() -> Any:
    """The ``redroll`` tracer when OpenTelemetry is installed and a tracer provider is set, else None."""
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):  # (none set: no-op)
        return None
    return trace.get_tracer(TRACER_NAME)


def _ns(unix_s: float) -> int:
    return int(unix_s * 1e9)


def _context_of(traceparent: Optional[str]) -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": traceparent}) if traceparent else None


def traceparent_of(span: Any) -> Optional[str]:
    """The W3C ``traceparent`` of ``span`` (what travels in a request or record)."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent")


def submit_span(tr: Any, request: Any) -> Any:
    """Start the producer's span of one submit (a child of the caller's current span) and put its
    context in ``request.traceparent`` (unless the caller gave one: then the span is its child)."""
    from opentelemetry.trace import SpanKind

    span = tr.start_span("redroll.submit", context=_context_of(request.traceparent), kind=SpanKind.PRODUCER,
                         attributes={"redroll.request_id": request.request_id, "redroll.priority": request.priority})
    request.traceparent = traceparent_of(span)
    return span


def worker_spans(tr: Any, request: Any, record: Any, *, worker: str, entry_id: str, deliveries: int,
                 claimed_at: float, engine_ms: float) -> Any:
    """The worker's spans of one run, under the request's trace: ``redroll.queue`` (submit to
    claim) and ``redroll.engine`` (ended now), then, with a ``record``, ``redroll.publish`` (started
    now, returned: end it with :func:`end_span` once the finish settled) whose context goes in
    ``record.traceparent``. Without one (the run was handed back: a drain) the engine span says so."""
    from opentelemetry.trace import SpanKind

    parent = _context_of(request.traceparent)
    now = time.time()
    attrs = {"redroll.request_id": request.request_id, "redroll.worker": worker, "redroll.entry_id": entry_id,
             "redroll.deliveries": deliveries}
    if request.submitted_at is not None:
        queue = tr.start_span("redroll.queue", context=parent, start_time=_ns(request.submitted_at), attributes=attrs)
        queue.end(end_time=_ns(max(claimed_at, request.submitted_at)))
    outcome = ({"redroll.status": record.status.value, "redroll.tokens": sum(map(len, record.output_token_ids))}
               if record is not None else {"redroll.status": "handed back"})
    engine = tr.start_span("redroll.engine", context=parent, start_time=_ns(now - engine_ms / 1000.0),
                           kind=SpanKind.CONSUMER, attributes={**attrs, **outcome})
    engine.end(end_time=_ns(now))
    if record is None:
        return None
    publish = tr.start_span("redroll.publish", context=parent, kind=SpanKind.PRODUCER, attributes=attrs)
    record.traceparent = traceparent_of(publish)
    return publish


def end_span(span: Any, **attributes: Any) -> None:
    if span is not None:
        for key, value in attributes.items():
            span.set_attribute(f"redroll.{key}", value)
        span.end()


async def traced(tr: Any, record: Any, group: str, awaitable: Any) -> Any:
    """Await an async handler's ``awaitable`` inside its :func:`callback_span`."""
    with callback_span(tr, record, group):
        return await awaitable


def callback_span(tr: Any, record: Any, group: str) -> Any:
    """A consumer group's span of applying one record (a child of the worker's publish span);
    use as a context manager."""
    from opentelemetry.trace import SpanKind

    return tr.start_as_current_span("redroll.callback", context=_context_of(record.traceparent),
                                    kind=SpanKind.CONSUMER,
                                    attributes={"redroll.request_id": record.request_id, "redroll.group": group,
                                                "redroll.status": record.status.value})
