"""OpenTelemetry tracing (the ``tracing`` extra): one trace per request, from the producer's submit
through each worker that ran it to the consumer group's callback (in-memory exporter, real redis-server)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from redroll.engine_worker.engines.synthetic import SyntheticEngine  # noqa: E402
from redroll.engine_worker.worker import Worker  # noqa: E402
from redroll.observability import tracing  # noqa: E402
from redroll.ops.trace import request_timeline  # noqa: E402
from redroll.producer import Producer  # noqa: E402
from redroll.producer.client import make_request, send  # noqa: E402
from redroll.shared.types import RecordStatus  # noqa: E402
from tests.conftest import running, wait_until, workers_and_consumer  # noqa: E402

PROMPT = list(range(1, 9))


@pytest.fixture
def spans(monkeypatch):
    """A tracer provider for this test only (the process's global one is never set: once set, it
    stays for every later test), exporting to memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    yield exporter
    provider.shutdown()


def _of(exporter, request_id: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for span in exporter.get_finished_spans():
        if span.attributes.get("redroll.request_id") == request_id:
            out.setdefault(span.name, []).append(span)
    return out


def test_no_tracer_provider_means_no_tracing():
    assert tracing.tracer() is None  # (the API's default provider is a no-op: nothing is traced)


async def test_one_trace_per_request_from_submit_to_callback(settings, r, spans):
    applied: list[str] = []
    fleet, consumer = workers_and_consumer(settings, applied, workers=1)
    async with running(*fleet, consumer):
        await send(settings, r, [make_request(request_id=f"t-{i}", input_ids=PROMPT, callback="h",
                                              sampling_params={"max_new_tokens": 4}) for i in range(2)])
        await wait_until(lambda: sorted(applied) == ["t-0", "t-1"], 30)
        await wait_until(lambda: all("redroll.callback" in _of(spans, f"t-{i}") for i in range(2)), 10)
    trace_ids = set()
    for i in range(2):
        got = _of(spans, f"t-{i}")
        assert sorted(got) == ["redroll.callback", "redroll.engine", "redroll.publish", "redroll.queue",
                               "redroll.submit"]
        (submit,), (queue,), (engine,), (publish,), (callback,) = (got[n] for n in (
            "redroll.submit", "redroll.queue", "redroll.engine", "redroll.publish", "redroll.callback"))
        ids = {s.context.trace_id for spans_ in got.values() for s in spans_}
        assert len(ids) == 1  # one trace
        trace_ids |= ids
        assert submit.parent is None
        for child in (queue, engine, publish):
            assert child.parent.span_id == submit.context.span_id
        assert callback.parent.span_id == publish.context.span_id
        assert queue.start_time <= queue.end_time <= engine.end_time
        assert engine.attributes["redroll.worker"] == fleet[0].name and engine.attributes["redroll.tokens"] == 4
        assert callback.attributes["redroll.group"] == "g" and publish.attributes["redroll.published"] is True
    assert len(trace_ids) == 2  # one per request


@pytest.mark.slow
async def test_a_resumed_request_shows_both_workers_in_one_trace(settings, r, spans):
    s = settings.with_(checkpoint_tokens=20, checkpoint_interval_s=0.1, checkpoint_min_new_tokens=50,
                       drain_timeout_s=0.2)
    a = Worker(s, SyntheticEngine(token_ms=5), max_inflight=4, block_ms=100, name="a")
    b = Worker(s, SyntheticEngine(token_ms=5), max_inflight=4, block_ms=100, name="b")
    request = make_request(request_id="resumed-1", input_ids=PROMPT, resumable=True,
                           sampling_params={"max_new_tokens": 300, "sampling_seed": 7})
    async with Producer(s) as p:
        task = asyncio.create_task(a.run())
        future = await p.submit(request)
        await wait_until(lambda: a.stats.checkpoints >= 2, 10)
        a.request_stop()  # (a drain: the entry is handed back, its checkpoint kept)
        await asyncio.wait_for(task, 10)
        async with running(b):
            record = await asyncio.wait_for(future, 20)
    assert record.status is RecordStatus.FINISHED and b.stats.resumed == 1
    got = _of(spans, "resumed-1")
    (submit,) = got["redroll.submit"]
    engines = sorted(got["redroll.engine"], key=lambda x: x.start_time)
    assert [(e.attributes["redroll.worker"], e.attributes["redroll.status"]) for e in engines] == [
        ("a", "handed back"), ("b", "finished")]
    assert {x.context.trace_id for spans_ in got.values() for x in spans_} == {submit.context.trace_id}
    assert all(x.parent.span_id == submit.context.span_id for n, xs in got.items() if n != "redroll.submit"
               for x in xs)
    # The event log tells the same story: handed back by a, finished by b.
    t = await request_timeline(r, s.partition_keys, "resumed-1")
    first, second = t.deliveries
    assert (first.worker, first.ended) == ("a", "handed back")
    assert (second.worker, second.previous, second.ended) == ("b", "a", "finished")
    assert second.why.startswith("handed back by a")
