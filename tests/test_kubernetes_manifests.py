"""The Kubernetes manifests (deploy/kubernetes/) start a worker against a fresh Redis with ACL
users: their commands are run here in the order Kubernetes runs them (the setup Job, the
worker's init container, the worker), each with the environment and the secret files its pod
spec gives it, against a real redis-server whose only user is the password-protected default
one. The worker runs the synthetic engine here (the manifest's vLLM needs a GPU); everything
else is the manifest's own."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from redroll.cli.main import build_parser
from redroll.producer.client import Producer
from redroll.shared.keys import WORKERS_GROUP, Keys
from redroll.shared.settings import Settings
from redroll.shared.types import RecordStatus
from tests.conftest import start_test_server
from tests.support.processes import ROOT, redroll_argv, start_process, stop_process

MANIFESTS = ROOT / "deploy" / "kubernetes"


def manifests() -> dict[str, dict]:
    docs = [d for path in sorted(MANIFESTS.glob("*.yaml")) for d in yaml.safe_load_all(path.read_text()) if d]
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


class Pod:
    """A pod spec's containers as local processes: secret volumes become files in ``root``, and
    every mount path in a container's command and environment points there."""

    def __init__(self, spec: dict, secrets: dict[str, dict], root: Path, redis_url: str):
        self.spec = spec
        self.redis_url = redis_url
        self.mounts: dict[str, Path] = {}
        for volume in spec.get("volumes", []):
            if "secret" not in volume:
                continue
            data = secrets[volume["secret"]["secretName"]]["stringData"]
            items = volume["secret"].get("items") or [{"key": k, "path": k} for k in data]
            folder = root / volume["name"]
            folder.mkdir(parents=True, exist_ok=True)
            for item in items:
                (folder / item["path"]).write_text(data[item["key"]])
            self.mounts[volume["name"]] = folder

    def container(self, name: str) -> dict:
        return next(c for c in [*self.spec.get("initContainers", []), *self.spec["containers"]] if c["name"] == name)

    def _local(self, container: dict, value: str) -> str:
        for mount in container.get("volumeMounts", []):
            if mount["name"] in self.mounts:
                value = value.replace(mount["mountPath"], str(self.mounts[mount["name"]]))
        return value

    def command(self, name: str, **env_override: str) -> tuple[list[str], dict[str, str]]:
        container = self.container(name)
        argv = [self._local(container, a) for a in container["command"]]
        assert argv[0] == "redroll", argv
        env = {e["name"]: self._local(container, e["value"]) for e in container.get("env", [])}
        assert env["REDROLL_REDIS_URL"].startswith("redis://redis:6379"), env
        env["REDROLL_REDIS_URL"] = self.redis_url
        env.update(env_override)
        return redroll_argv(*argv[1:]), {**os.environ, "PYTHONPATH": str(ROOT), **env}

    def run(self, name: str, timeout: float = 60, **env_override: str) -> subprocess.CompletedProcess:
        argv, env = self.command(name, **env_override)
        return subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def fresh_redis():
    docs = manifests()
    admin = docs["Secret/redroll-redis"]["stringData"]["admin"]
    server = start_test_server("--requirepass", admin)
    yield server, admin
    server.stop()


async def test_the_manifests_start_a_worker_against_a_fresh_redis_with_acl_users(fresh_redis, tmp_path):
    server, admin = fresh_redis
    docs = manifests()
    secrets = {name.split("/", 1)[1]: d for name, d in docs.items() if name.startswith("Secret/")}
    job = Pod(docs["Job/redroll-setup"]["spec"]["template"]["spec"], secrets, tmp_path / "job", server.url)
    deployment = docs["Deployment/redroll-engine-worker"]
    worker_pod = Pod(deployment["spec"]["template"]["spec"], secrets, tmp_path / "worker", server.url)

    # Before the Job: the worker's user does not exist, the init container keeps the worker back.
    waiting = worker_pod.run("wait-for-functions", timeout=60, REDROLL_LOG_LEVEL="error")
    assert waiting.returncode != 0
    # The Job, twice (a re-run after a failure must not break anything).
    for _ in range(2):
        setup = job.run("setup")
        assert setup.returncode == 0, setup.stderr
    assert "redroll-worker (worker)" in setup.stdout and "function library" in setup.stdout
    assert worker_pod.run("wait-for-functions").returncode == 0

    argv, env = worker_pod.command("worker", REDROLL_ENGINE="synthetic")
    worker = start_process(argv, env=env, log=tmp_path / "worker.log")
    secret = secrets["redroll-redis"]["stringData"]
    try:
        producer_settings = Settings(redis_url=server.url, namespace="redroll", redis_username="redroll-producer",
                                     redis_password=secret["producer"])
        async with Producer(producer_settings) as producer:
            record = await asyncio.wait_for(
                await producer.submit(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4}), 60)
        assert record.status is RecordStatus.FINISHED, record
        status = subprocess.run(redroll_argv("status", "--json"), cwd=ROOT, capture_output=True, text=True,
                                env={**env, "REDROLL_REDIS_USERNAME": "redroll-operator",
                                     "REDROLL_REDIS_PASSWORD": secret["operator"],
                                     "REDROLL_REDIS_PASSWORD_FILE": ""}, timeout=60)
        assert status.returncode == 0, status.stderr
        assert len(json.loads(status.stdout)["workers"]) == 1
    finally:
        assert stop_process(worker) == 0


def test_the_grace_period_covers_the_drain_and_keda_watches_the_workers_stream():
    docs = manifests()
    pod = docs["Deployment/redroll-engine-worker"]["spec"]["template"]["spec"]
    worker = next(c for c in pod["containers"] if c["name"] == "worker")
    env = {e["name"]: e["value"] for e in worker["env"]}
    drain = float(env["REDROLL_DRAIN_TIMEOUT_S"])
    assert pod["terminationGracePeriodSeconds"] >= drain + 5  # (drain, then the hand-back, before SIGKILL)
    assert "--max-inflight" not in worker["command"]  # (the engine's batch decides)
    build_parser().parse_args(worker["command"][1:])  # (every flag exists)
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    keys = Keys(env["REDROLL_NAMESPACE"])
    scaled = docs["ScaledObject/redroll-engine-worker"]
    assert scaled["spec"]["scaleTargetRef"]["name"] == "redroll-engine-worker"
    kinds = set()
    for trigger in scaled["spec"]["triggers"]:
        assert trigger["type"] == "redis-streams"
        assert trigger["metadata"]["stream"] == keys.requests
        assert trigger["metadata"]["consumerGroup"] == WORKERS_GROUP
        kinds |= {k for k in ("pendingEntriesCount", "streamLength") if k in trigger["metadata"]}
    assert kinds == {"pendingEntriesCount", "streamLength"}
    # With affinity lanes: the summed gauge the workers export, through Prometheus.
    lanes = docs["ScaledObject/redroll-engine-worker-lanes"]
    assert lanes["spec"]["scaleTargetRef"]["name"] == "redroll-engine-worker"
    (trigger,) = lanes["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and "max(redroll_pipeline_queued" in trigger["metadata"]["query"]
