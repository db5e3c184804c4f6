"""``import sglang`` for worker subprocesses in the tests: the stand-in (tests/sglang_standin).

Put ``tests/fake_sglang`` first on PYTHONPATH; ``REDROLL_STANDIN_OPTIONS`` (JSON) sets the
stand-in's knobs (tests.sglang_standin.engine.StandInOptions).
"""

import json
import os

from tests.sglang_standin import Engine as _Engine
from tests.sglang_standin import __version__  # noqa: F401

_options = json.loads(os.environ.get("REDROLL_STANDIN_OPTIONS") or "{}")
Engine = _Engine.with_options(**_options) if _options else _Engine
