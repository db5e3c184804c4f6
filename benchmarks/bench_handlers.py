"""Callback handlers the benchmark registers on ``redroll consume``.

``count`` is the cheapest thing that can tell the suite when the last callback was applied: an
in-process counter; when it reaches ``$BENCH_EXPECT`` the handler writes one small JSON file
(``$BENCH_DONE_FILE``: time of the first and last callback, count). No Redis call, no I/O per
record.

``latency`` also keeps, per record, (callback time − submitted_at, engine_ms, queue_ms) and writes
them with the done file, for the consumer-path latency figures.
"""

from __future__ import annotations

import os
import time

from redroll.shared.types import CompletionRecord

_EXPECT = int(os.environ.get("BENCH_EXPECT", "0") or 0)
_DONE = os.environ.get("BENCH_DONE_FILE", "")
_state = {"n": 0, "first": 0.0, "written": False}
_samples: list[tuple[float, float, float]] = []


def _finish(extra: dict | None = None) -> None:
    from benchmarks.harness import write_json_atomic

    out = {"count": _state["n"], "t_first": _state["first"], "t_last": time.time()}
    out.update(extra or {})
    _state["written"] = True
    if _DONE:
        write_json_atomic(_DONE, out)


def count(record: CompletionRecord) -> None:
    n = _state["n"] = _state["n"] + 1
    if n == 1:
        _state["first"] = time.time()
    if n >= _EXPECT and not _state["written"]:
        _finish()


def latency(record: CompletionRecord) -> None:
    now = time.time()
    meta = record.meta_info
    submitted = meta.get("bench_submitted_at")
    if submitted is not None:
        _samples.append(((now - submitted) * 1000.0, float(meta.get("engine_ms", 0.0)),
                         float(meta.get("queue_ms", 0.0))))
    n = _state["n"] = _state["n"] + 1
    if n == 1:
        _state["first"] = now
    if n >= _EXPECT and not _state["written"]:
        _finish({"samples": _samples})
