"""``benchmarks.worker_drain``: the copy of the package a process imports, the compiled build, one drain.

Speed is not judged here (the bench prints it); these check that the worker drains every request
it was given, and that a compiled run really imports the compiled modules.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks.harness import BenchError, Server
from benchmarks.worker_drain import build_compiled, drain, imported_files, package_tree


def test_a_process_started_in_the_package_tree_imports_redroll_from_it(tmp_path):
    tree = package_tree(tmp_path / "tree")
    paths = imported_files(tree, ("redroll.cli", "redroll.shared.codec", "redroll.engine_worker.engines.synthetic",
                                   "redroll.consumer.runner"))
    assert len(paths) == 4 and all(Path(p).is_relative_to(tree) for p in paths)
    assert (tree / "redroll" / "shared" / "lua" / "finish_many.lua").is_file()  # (the scripts come along)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_compiled_build_is_what_a_process_imports(tmp_path):
    tree = build_compiled(tmp_path / "compiled", ("redroll.engine_worker.records",))
    (records, codec) = imported_files(tree, ("redroll.engine_worker.records", "redroll.shared.codec"))
    assert records.endswith(".so") and codec.endswith(".py")


def test_without_cython_the_compiled_run_is_refused_with_the_remedy(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "Cython", None)  # (an import of it raises ImportError)
    with pytest.raises(BenchError, match="pip install cython"):
        build_compiled(tmp_path / "compiled")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_worker_drains_every_queued_request(tmp_path):
    server = Server()
    try:
        run = drain(server, tmp_path, 3_000, 500)
        assert server.r.xlen("{bench}:results") == 3_000
        assert server.r.xlen("{bench}:requests") == 0
    finally:
        server.stop()
    assert run["rate"] > 0 and run["worker_us"] > 0 and run["redis_us"] > 0
