"""The queue core imports and runs without torch, transformers or sglang."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT

BLOCK = "import sys\nfor m in ('torch', 'transformers', 'sglang'):\n    sys.modules[m] = None\n"


def test_core_imports_and_demo_runs_without_engine_libraries():
    code = BLOCK + (
        "import redroll, redroll.shared, redroll.producer, redroll.consumer, redroll.engine_worker.worker\n"
        "import redroll.engine_worker.engines.synthetic, redroll.engine_worker.engines.transformers_engine\n"
        "import redroll.engine_worker.engines.tiny_model\n"
        "from redroll.cli.demo_run import _has_torch\n"
        "assert not _has_torch()\n"
        "from redroll.cli.main import main\n"
        "sys.exit(main(['demo']))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDROLL_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "synthetic engine" in proc.stdout
    assert proc.stdout.count("] finished") >= 4
