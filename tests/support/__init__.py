"""Helpers shared by the tests and the benchmarks, one copy each: a poller (:mod:`.poll`), a
subprocess helper (:mod:`.processes`) and a restartable redis-server (:mod:`.servers`, on top of
:func:`redroll.testing.embedded.start_redis_server`, which starts every server). The chaos harness that
``tests/test_chaos.py`` runs and ``python -m benchmarks.chaos`` prints is :mod:`tests.chaos`.

Nothing here imports pytest: the benchmarks run without it."""
