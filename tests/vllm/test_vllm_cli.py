"""``redroll worker --engine vllm`` refuses what cannot work in one line, before starting vLLM."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def _worker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "redroll.cli", "worker", "--engine", "vllm", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_sleep_mode_on_cpu_is_refused_in_one_line(tiny_checkpoints, redis_server):
    proc = _worker("--model-path", str(tiny_checkpoints[0]), "--enable-memory-saver",
                   "--redis-url", redis_server.url, "--namespace", "clitest")
    lines = [line for line in proc.stderr.splitlines() if line.startswith("redroll worker:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(lines) == 1 and "no sleep mode on CPU" in lines[0] and "--enable-memory-saver" in lines[0]


def test_a_bad_vllm_arg_is_refused_in_one_line(tiny_checkpoints):
    proc = _worker("--model-path", str(tiny_checkpoints[0]), "--vllm-arg", "max_num_seqs")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "redroll worker: --vllm-arg 'max_num_seqs' must look like KEY=VALUE" in proc.stderr
