"""redroll.cli.runtime: entry points run on the fastest loop, with what exists at start frozen."""

from __future__ import annotations

import gc

from redroll.cli import runtime


def test_run_returns_the_coroutines_result_and_freezes_what_exists_at_start():
    gc.unfreeze()
    made_before = [1]  # (a list: the collector tracks it)

    async def main() -> int:
        return 42

    try:
        assert runtime.run(main()) == 42
        assert gc.get_freeze_count() > 0
        # what existed before the entry point started is out of the collector's sight
        assert not any(o is made_before for o in gc.get_objects())
    finally:
        gc.unfreeze()


def test_the_standard_loop_when_asked(monkeypatch):
    monkeypatch.setenv("REDROLL_UVLOOP", "0")
    assert runtime.loop_factory() is None
    assert runtime.loop_name() == "asyncio"
