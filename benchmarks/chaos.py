"""The chaos run's command line: ``python -m benchmarks.chaos [--requests 5000] ...``.

The harness itself is :mod:`tests.chaos` (one copy: ``tests/test_chaos.py`` runs it reduced);
``--help`` lists its options."""

from __future__ import annotations

import sys

from tests.chaos import main

if __name__ == "__main__":
    sys.exit(main())
