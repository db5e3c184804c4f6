"""The vLLM image and its compose service: the Dockerfile's ``vllm`` stage installs exactly the
release the adapter's contract names (vllm_contract.GPU_WHEEL), the SGLang image stays the default,
and compose.yaml runs a vLLM worker from that stage with flags the real parser takes."""

from __future__ import annotations

import re

import yaml

from redroll.cli.main import build_parser
from redroll.engine_worker.engines import vllm_contract
from tests.conftest import ROOT

DOCKERFILE = (ROOT / "Dockerfile").read_text()
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())


def _stages() -> dict[str, str]:
    """Stage name → its text (from its FROM line to the next FROM)."""
    parts = re.split(r"^(?=FROM )", DOCKERFILE, flags=re.M)
    stages = {}
    for part in parts[1:]:
        m = re.match(r"FROM \S+ AS (\S+)$", part.splitlines()[0])
        assert m, f"every stage is named: {part.splitlines()[0]!r}"
        stages[m[1]] = part
    return stages


def _defaults(text: str) -> str:
    """Compose's ``${NAME:-default}`` as its default."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", text)


def test_the_vllm_version_is_the_contracts_gpu_wheel():
    dist, version = vllm_contract.GPU_WHEEL
    assert dist == "vllm"
    (pinned,) = re.findall(r"^ARG VLLM_VERSION=(\S+)$", DOCKERFILE, re.M)
    assert pinned == version
    # a release the adapter accepts at start
    vllm_contract.check_version(pinned)


def test_the_vllm_stage_installs_exactly_that_version_on_the_official_image():
    stages = _stages()
    assert "vllm" in stages
    stage = stages["vllm"]
    (base,) = re.findall(r"^ARG VLLM_BASE_IMAGE=(\S+)$", DOCKERFILE, re.M)
    assert base == "vllm/vllm-openai:v${VLLM_VERSION}"
    assert stage.startswith("FROM ${VLLM_BASE_IMAGE} AS vllm")
    assert re.search(r"^ARG VLLM_VERSION$", stage, re.M)  # the global ARG, visible inside the stage
    assert re.search(r'pip install[^\n]*"vllm==\$\{VLLM_VERSION\}"[^\n]*"\.\[metrics\]"', stage)
    # the build fails when another vllm is installed
    assert "vllm.__version__" in stage and "sys.exit" in stage
    assert re.search(r"^ENTRYPOINT \[\]$", stage, re.M)  # not the official image's `vllm serve`


def test_the_sglang_image_stays_the_default_target():
    stages = _stages()
    assert list(stages)[-1] == "sglang"  # `docker build .` builds the last stage
    code = {name: re.sub(r"^#.*\n", "", text, flags=re.M) for name, text in stages.items()}
    assert "sglang==${SGLANG_VERSION}" in code["sglang"] and "vllm" not in code["sglang"]
    assert "sglang" not in code["vllm"]
    # every ARG used in a FROM line is declared before the first stage
    globals_ = DOCKERFILE.split("\nFROM ", 1)[0]
    for name in re.findall(r"^FROM \$\{(\w+)\}", DOCKERFILE, re.M):
        assert re.search(rf"^ARG {name}=", globals_, re.M), name


def test_compose_has_a_vllm_worker_on_the_vllm_target():
    services = COMPOSE["services"]
    worker = services["engine_worker_vllm"]
    assert worker["profiles"] == ["vllm"]  # `docker compose up` alone still runs SGLang only
    assert worker["build"]["target"] == "vllm" and worker["image"] == "redroll:vllm"
    assert services["engine_worker_0"]["build"]["target"] == "sglang"
    assert services["engine_worker_0"]["image"] != worker["image"]
    cmd = worker["command"]
    assert cmd[:2] == ["redroll", "worker"]
    args = build_parser().parse_args([_defaults(c) for c in cmd[1:]])
    assert args.engine == "vllm" and args.model_path.startswith("/models/")
    assert args.tp_size == 1 and args.memory_fraction == 0.85 and args.drain_timeout == 60
    assert "${VLLM_TP_SIZE:-1}" in cmd and "${VLLM_GPU_MEMORY_UTILIZATION:-0.85}" in cmd
    (gpu,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"] and "count" not in gpu
    assert worker["ipc"] == "host" and worker["shm_size"]
    assert any(v.endswith(":/models:ro") for v in worker["volumes"])
    assert worker["stop_signal"] == "SIGTERM"
