"""Prometheus metrics for workers and consumers (``--metrics-port``; needs ``redroll[metrics]``).

Counters are read from the process's own stats at scrape time (nothing to keep in step); the two
latency histograms are observed as records are published. Each process has its own registry.

Worker metrics:
    redroll_worker_requests_total{outcome}   records published by outcome (finished, aborted,
                                             expired, error), plus dead_lettered and fenced
    redroll_worker_inflight                  requests being generated now
    redroll_worker_queue_wait_seconds        histogram: submit → claim
    redroll_worker_engine_seconds            histogram: time in the engine
    redroll_worker_tokens_generated_total    output tokens
    redroll_worker_claims_total{kind}        new (XREADGROUP) and reclaimed (from dead workers, hand-backs)
    redroll_worker_lease_losses_total        leases found taken by another worker
    redroll_worker_dead_letters_total        requests dead-lettered by this worker
    redroll_worker_engine_errors_total       engine exceptions (the request is retried)
    redroll_worker_weight_version_info{weight_version}  1 for the version being served
    redroll_worker_publish_blocked           streams refusing this worker's writes now (0 = none):
                                             while > 0 it claims nothing and holds its records
    redroll_worker_refusals_total{kind}      writes Redis refused (out_of_memory, ids_exhausted,
                                             wrong_type, read_only, transient, other)
Consumer metrics:
    redroll_consumer_callbacks_total{outcome}  applied, duplicate (skipped), failed (to be retried)
    redroll_consumer_dead_letters_total        records dead-lettered (bad, no handler, out of retries)
    redroll_consumer_reclaimed_total           records taken over from other consumers
    redroll_consumer_trimmed_total             records trimmed once every group had acked them
    redroll_consumer_callback_seconds          histogram: callback duration
    redroll_consumer_blocked                   1 while Redis refuses its applied markers (it reads nothing)
    redroll_consumer_refusals_total            markers or dead letters Redis refused
Pipeline metrics (``redroll_pipeline_*``, ``redroll_redis_*``, ``redroll_exporter_*``): served by
``redroll exporter`` from Redis alone, whether or not a worker runs; see :mod:`redroll.observability.exporter`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def _require() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise RuntimeError("--metrics-port needs prometheus-client: pip install 'redroll[metrics]'") from None
    return prometheus_client


class _StatsCollector:
    """Yields metric families computed from a stats snapshot function at each scrape."""

    def __init__(self, families: Callable[[], Iterable[Any]]):
        self._families = families

    def collect(self) -> Iterable[Any]:
        return self._families()


class _ProcessMetrics:
    """A process's own registry: the counters its ``_families`` read from ``process`` (a worker or a
    consumer runner) at each scrape, and the latency histograms made with :meth:`_histogram`."""

    def __init__(self, process: Any):
        self._process = process
        self._pc = _require()
        self.registry = self._pc.CollectorRegistry()
        self.registry.register(_StatsCollector(self._families))

    def _histogram(self, name: str, documentation: str) -> Any:
        return self._pc.Histogram(name, documentation, buckets=LATENCY_BUCKETS, registry=self.registry)

    def _families(self) -> Iterable[Any]:
        raise NotImplementedError


class WorkerMetrics(_ProcessMetrics):
    def __init__(self, worker: Any):
        super().__init__(worker)
        self.queue_wait = self._histogram("redroll_worker_queue_wait_seconds", "Submit to claim.")
        self.engine_time = self._histogram("redroll_worker_engine_seconds", "Time in the engine.")

    def observe(self, queue_ms: float | None, engine_ms: float | None) -> None:
        if queue_ms is not None:
            self.queue_wait.observe(queue_ms / 1000.0)
        if engine_ms is not None:
            self.engine_time.observe(engine_ms / 1000.0)

    def _families(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self._process.stats
        req = CounterMetricFamily("redroll_worker_requests", "Records published, by outcome.", labels=["outcome"])
        for outcome in ("finished", "aborted", "expired", "error"):
            req.add_metric([outcome], st.by_status.get(outcome, 0))
        req.add_metric(["dead_lettered"], st.dead_lettered)
        req.add_metric(["fenced"], st.fenced)
        yield req
        yield GaugeMetricFamily("redroll_worker_inflight", "Requests in flight.", value=self._process.inflight_count)
        yield CounterMetricFamily("redroll_worker_tokens_generated", "Output tokens.", value=st.tokens)
        claims = CounterMetricFamily("redroll_worker_claims", "Entries claimed.", labels=["kind"])
        claims.add_metric(["new"], st.claimed)
        claims.add_metric(["reclaimed"], st.reclaimed)
        yield claims
        if st.claims_by_kind:
            lanes = CounterMetricFamily("redroll_worker_lane_claims", "Entries claimed with affinity lanes, by where "
                                        "from (high, own, shared, stolen, woken).", labels=["kind"])
            for kind, count in sorted(st.claims_by_kind.items()):
                lanes.add_metric([kind], count)
            yield lanes
        if st.queued is not None:
            yield GaugeMetricFamily("redroll_pipeline_queued", "Entries waiting in the request streams this worker "
                                    "reads (high, lanes, shared), summed: scale on max() over the workers.",
                                    value=st.queued)
        if self._process.capabilities.prefill_counters:
            engine = self._process.engine
            prefill = CounterMetricFamily("redroll_worker_prefill_tokens", "Prompt tokens: computed by prefill, or "
                                          "served from the prefix cache.", labels=["kind"])
            prefill.add_metric(["computed"], engine.prefill_tokens_computed)
            prefill.add_metric(["cached"], engine.prefill_tokens_cached)
            yield prefill
        yield CounterMetricFamily("redroll_worker_checkpoints", "Checkpoint parts saved for resumable requests.",
                                  value=st.checkpoints)
        yield CounterMetricFamily("redroll_worker_resumed", "Requests continued from a checkpoint.", value=st.resumed)
        yield CounterMetricFamily("redroll_worker_lease_losses", "Leases lost to another worker.", value=st.lease_losses)
        yield CounterMetricFamily("redroll_worker_dead_letters", "Requests dead-lettered.", value=st.dead_lettered)
        yield CounterMetricFamily("redroll_worker_engine_errors", "Engine exceptions.", value=st.engine_errors)
        info = GaugeMetricFamily("redroll_worker_weight_version_info", "Weight version served.",
                                 labels=["weight_version"])
        info.add_metric([str(self._process.engine.info.weight_version)], 1)
        yield info
        yield GaugeMetricFamily("redroll_worker_publish_blocked", "Streams refusing this worker's writes.",
                                value=len(self._process.blocked))
        refusals = CounterMetricFamily("redroll_worker_refusals", "Writes Redis refused.", labels=["kind"])
        for kind, n in sorted(st.refusals.items()):
            refusals.add_metric([kind], n)
        yield refusals


class ConsumerMetrics(_ProcessMetrics):
    def __init__(self, runner: Any):
        super().__init__(runner)
        self.callback_time = self._histogram("redroll_consumer_callback_seconds", "Callback duration.")

    def observe(self, seconds: float) -> None:
        self.callback_time.observe(seconds)

    def _families(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self._process.stats
        cb = CounterMetricFamily("redroll_consumer_callbacks", "Callbacks by outcome.", labels=["outcome"])
        cb.add_metric(["applied"], st.applied)
        cb.add_metric(["duplicate"], st.duplicates_skipped)
        cb.add_metric(["failed"], st.failures)
        yield cb
        yield CounterMetricFamily("redroll_consumer_dead_letters", "Records dead-lettered.", value=st.dead_lettered)
        yield CounterMetricFamily("redroll_consumer_reclaimed", "Records reclaimed.", value=st.reclaimed)
        yield CounterMetricFamily("redroll_consumer_trimmed", "Records trimmed.", value=st.trimmed)
        yield GaugeMetricFamily("redroll_consumer_blocked", "1 while Redis refuses the applied markers.",
                                value=int(self._process.blocked is not None))
        yield CounterMetricFamily("redroll_consumer_refusals", "Markers or dead letters Redis refused.",
                                  value=st.refusals)


def serve(metrics: Any, port: int, addr: str = "127.0.0.1") -> Any:
    """Serve ``metrics.registry`` (worker, consumer or :class:`redroll.observability.exporter.PipelineMetrics`) as
    ``/metrics`` on ``port`` (0 = any free port) in a thread; returns the server."""
    pc = _require()
    server, _thread = pc.start_http_server(port, addr=addr, registry=metrics.registry)
    return server
