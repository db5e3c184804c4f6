"""Observability: logs, Prometheus metrics (workers, consumers, the pipeline exporter) and
OpenTelemetry traces."""
