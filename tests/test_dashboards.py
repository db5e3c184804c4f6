"""The Grafana board and the Prometheus alert rules name only metrics the project exports.

Every PromQL expression (the board's targets, the rules' ``expr``) is tokenized; the metric names it
uses must be among those the project's metric objects expose: the worker's, the consumer's and
``redroll exporter``'s registries are instantiated and collected (not grepped), and each family's
name gives the series names Prometheus sees (a counter's ``_total``, a histogram's
``_bucket``/``_sum``/``_count``).
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import yaml

from tests.conftest import ROOT

pytest.importorskip("prometheus_client")

BOARD = ROOT / "deploy" / "grafana" / "redroll.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"

KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
            "offset", "inf", "nan", "atan2"}
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("_sum", "_count", "_created"), "info": ("_info",), "gaugehistogram": ("_bucket", "_gsum",
                                                                                              "_gcount")}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression uses (a tokenizer, not a parser: enough for our queries)."""
    s = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`', '""', expr)  # string literals
    s = re.sub(r"\{[^{}]*\}", "{}", s)  # label matchers
    s = re.sub(r"\[[^\[\]]*\]", "[]", s)  # ranges and subqueries ([5m], [$__rate_interval], [1h:1m])
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", r"\1", s)  # label lists
    s = re.sub(r"\$\{?\w+\}?", "", s)  # Grafana variables
    names = set()
    for m in re.finditer(r"(?<![\w.:])[A-Za-z_:][\w:]*", s):
        name = m.group(0)
        if name.lower() in KEYWORDS or re.match(r"\s*(\(|by\b|without\b)", s[m.end():]):  # a function, an aggregation
            continue
        names.add(name)
    return names


def stripped(name: str) -> str:
    """``name`` without the suffix Prometheus clients add to a family's samples."""
    return re.sub(r"_(total|bucket|sum|count|created|info)$", "", name)


def _stub_worker() -> Any:
    from redroll.engine_worker.context import WorkerStats

    stats = WorkerStats(queued=1, claims_by_kind={"own": 1}, by_status={"finished": 1}, refusals={"out_of_memory": 1})
    engine = SimpleNamespace(info=SimpleNamespace(weight_version="v1"), prefill_tokens_computed=1,
                             prefill_tokens_cached=1)
    return SimpleNamespace(stats=stats, inflight_count=0, capabilities=SimpleNamespace(prefill_counters=True),
                           engine=engine, blocked={})


def _stub_consumer() -> Any:
    from redroll.consumer.batch import ConsumerStats

    return SimpleNamespace(stats=ConsumerStats(), blocked=None)


def full_snapshot() -> dict[str, Any]:
    """A snapshot with every optional part (partitions, lanes, groups, a desired version, memory)."""
    worker = {"name": "w", "host": "h", "engine": "synthetic", "model": "m", "weight_version": "v1", "state": "running",
              "inflight": 1, "max_inflight": 4, "tokens_per_s_1m": 1.0, "age_s": 0.1, "alive": True}
    return {
        "status": {
            "requests": {"backlog": 1, "pending": 1, "oldest_pending_idle_ms": 5, "oldest_pending_age_ms": 9,
                         "pending_per_consumer": {"w": 1}, "delivery_histogram": {"1": 1}},
            "requests_high": {"backlog": 0, "pending": 0},
            "lanes": {"lanes": 1, "backlog": 0, "pending": 0,
                      "per_lane": [{"partition": "{n}", "lane": 0, "backlog": 0, "pending": 0}]},
            "partitions": [{"tag": "{n:0}", "queued": 1, "in_flight": 1, "dead_letters": 0}],
            "results": {"length": 0, "groups": [{"group": "g", "consumers": 1, "pending": 0, "backlog": 0}]},
            "dead_letters": 0, "aborted_ids": 0, "rates_1m": {"requests_per_s": 0.0, "tokens_per_s": 0.0},
            "workers": [worker], "workers_alive": 1, "workers_stale": 0, "alerts": ["worker w is blocked (...)"],
        },
        "desired_weights": {"weight_version": "v2", "model_path": "/w"},
        "memory": [{"node": "", "used": 1, "max": 2, "noeviction": True}],
    }


def exported_names() -> set[str]:
    """Every series name the project's metric objects expose, from their registries' collect()."""
    from redroll.observability.exporter import PipelineMetrics
    from redroll.observability.metrics import ConsumerMetrics, WorkerMetrics

    pipeline = PipelineMetrics()
    pipeline.snapshot = full_snapshot()
    names = set()
    for metrics in (WorkerMetrics(_stub_worker()), ConsumerMetrics(_stub_consumer()), pipeline):
        for family in metrics.registry.collect():
            if family.type not in SUFFIXES:  # a gauge's series is its family's name; a counter's is NAME_total
                names.add(family.name)
            names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ()))
            names.update(sample.name for sample in family.samples)
    return names


def unknown_metrics(queries: dict[str, str], exported: set[str]) -> dict[str, list[str]]:
    """Per query's place, the metric names it uses that nothing exports."""
    families = {stripped(n) for n in exported}
    out = {}
    for where, expr in queries.items():
        missing = sorted(n for n in metric_names(expr) if n not in exported)
        if missing:
            out[where] = [f"{n} (no family {stripped(n)!r})" if stripped(n) not in families else
                          f"{n} (family {stripped(n)!r} has no such series)" for n in missing]
    return out


def _board_panels(panels: list[dict]) -> Iterator[dict]:
    for p in panels:
        yield p
        yield from _board_panels(p.get("panels") or [])


def board_queries() -> dict[str, str]:
    board = json.loads(BOARD.read_text())
    return {f"panel {p['title']!r} target {t['refId']}": t["expr"]
            for p in _board_panels(board["panels"]) for t in p.get("targets") or []}


def alert_queries() -> dict[str, str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return {f"rule {rule.get('alert') or rule.get('record')}": rule["expr"]
            for group in rules["groups"] for rule in group["rules"]}


@pytest.fixture(scope="module")
def exported() -> set[str]:
    return exported_names()


def test_the_tokenizer_finds_metric_names_only():
    expr = ('histogram_quantile(0.95, sum by (le, outcome) (rate(a_seconds_bucket{job=~"x|y", le!="+Inf"}'
            '[$__rate_interval]))) / ignoring (le) group_left (z) b_total offset 5m > 1e3 '
            'and on (job) c == bool 0 or absent(d) unless sum without (pod) (e[1h:5m])')
    assert metric_names(expr) == {"a_seconds_bucket", "b_total", "c", "d", "e"}
    assert metric_names('max(redroll_pipeline_queued)') == {"redroll_pipeline_queued"}
    assert stripped("redroll_worker_queue_wait_seconds_bucket") == "redroll_worker_queue_wait_seconds"


def test_the_project_exports_what_the_board_needs(exported):
    for name in ("redroll_worker_requests_total", "redroll_worker_queue_wait_seconds_bucket",
                 "redroll_consumer_callback_seconds_count", "redroll_pipeline_backlog",
                 "redroll_pipeline_workers_alive", "redroll_pipeline_desired_weight_version_info",
                 "redroll_redis_memory_used_bytes", "redroll_exporter_snapshot_errors_total"):
        assert name in exported, name


def test_the_checker_fails_on_a_metric_nobody_exports(exported):
    queries = {"panel 'fake'": 'sum(rate(redroll_worker_no_such_thing_total[5m])) / redroll_pipeline_backlog',
               "panel 'wrong suffix'": "redroll_pipeline_backlog_total",  # a gauge has no _total series
               "panel 'no suffix'": "rate(redroll_worker_requests[5m])",  # a counter's series is NAME_total
               "panel 'fine'": 'sum by (priority) (redroll_pipeline_backlog{priority="high"})'}
    bad = unknown_metrics(queries, exported)
    assert set(bad) == {"panel 'fake'", "panel 'wrong suffix'", "panel 'no suffix'"}
    assert bad["panel 'fake'"] == ["redroll_worker_no_such_thing_total (no family 'redroll_worker_no_such_thing')"]
    assert "has no such series" in bad["panel 'wrong suffix'"][0]
    assert "has no such series" in bad["panel 'no suffix'"][0]


def test_grafana_board_names_only_exported_metrics(exported):
    queries = board_queries()
    assert len(queries) >= 20
    assert unknown_metrics(queries, exported) == {}


def test_alert_rules_name_only_exported_metrics(exported):
    queries = alert_queries()
    assert unknown_metrics(queries, exported) == {}


def test_alert_rules_cover_what_operators_need():
    rules = {rule["alert"]: rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]}
    for name in ("RedrollBacklogWithNoLiveWorker", "RedrollDeadLettersGrowing", "RedrollPublishingBlocked",
                 "RedrollRedisRefusingWrites", "RedrollRedisOutOfMemory", "RedrollRedisNearMaxMemory",
                 "RedrollWorkersOnOldWeightVersion"):
        rule = rules[name]
        assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"], name
    for name, rule in rules.items():
        expr = rule["expr"]
        assert expr.count("(") == expr.count(")") and expr.count("[") == expr.count("]"), name
    assert "redroll_pipeline_workers_alive" in rules["RedrollBacklogWithNoLiveWorker"]["expr"]


def test_grafana_board_uses_its_datasource_variable_and_covers_the_topics():
    board = json.loads(BOARD.read_text())
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for p in _board_panels(board["panels"]) if p["type"] != "row"]
    assert len({p["id"] for p in _board_panels(board["panels"])}) == len(list(_board_panels(board["panels"])))
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        for t in p["targets"]:
            assert t.get("datasource", p["datasource"])["uid"] == "${datasource}", p["title"]
            expr = t["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), p["title"]
    used = set().union(*(metric_names(t["expr"]) for p in panels for t in p["targets"]))
    for topic in ("redroll_pipeline_backlog", "redroll_worker_tokens_generated_total",
                  "redroll_worker_queue_wait_seconds_bucket", "redroll_worker_engine_seconds_bucket",
                  "redroll_consumer_callback_seconds_bucket", "redroll_pipeline_workers",
                  "redroll_pipeline_dead_letters", "redroll_pipeline_desired_weight_version_info",
                  "redroll_pipeline_worker_info", "redroll_worker_refusals_total", "redroll_redis_memory_used_bytes"):
        assert topic in used, topic
