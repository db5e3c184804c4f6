"""The Kubernetes manifests (deploy/kubernetes/) start a worker against a fresh Redis with ACL
users: their commands are run here in the order Kubernetes runs them (the setup Job, the
worker's init container, the worker), each with the environment and the secret files its pod
spec gives it, against a real redis-server whose only user is the password-protected default
one. The worker runs the synthetic engine here (the manifest's vLLM needs a GPU); everything
else is the manifest's own."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from redroll.cli.main import build_parser
from redroll.producer.client import Producer
from redroll.shared.keys import Keys
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


def test_the_grace_period_covers_the_notice_and_keda_watches_the_request_streams():
    docs = manifests()
    pod = docs["Deployment/redroll-engine-worker"]["spec"]["template"]["spec"]
    worker = next(c for c in pod["containers"] if c["name"] == "worker")
    env = {e["name"]: e["value"] for e in worker["env"]}
    notice = float(env.get("REDROLL_NOTICE_S", Settings().notice_s))
    # (the notice, then the last save and hand-back, before the kubelet's SIGKILL; Kubernetes' default)
    assert pod["terminationGracePeriodSeconds"] == 30 and notice + 5 <= pod["terminationGracePeriodSeconds"]
    assert "REDROLL_DRAIN_TIMEOUT_S" not in env and "lifecycle" not in worker  # (no preStop eating the notice)
    assert "--max-inflight" not in worker["command"]  # (the engine's batch decides)
    build_parser().parse_args(worker["command"][1:])  # (every flag exists)
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    keys = Keys(env["REDROLL_NAMESPACE"])
    scaled = docs["ScaledObject/redroll-engine-worker"]
    assert scaled["spec"]["scaleTargetRef"]["name"] == "redroll-engine-worker"
    assert scaled["spec"]["minReplicaCount"] == 0  # (scale to zero, and back from it)
    streams = set()
    for trigger in scaled["spec"]["triggers"]:
        meta = trigger["metadata"]
        # (KEDA reads XLEN only without a consumerGroup: with one it reads XPENDING, which needs a
        # group that no worker may have made yet)
        assert trigger["type"] == "redis-streams" and "consumerGroup" not in meta and "streamLength" in meta
        assert meta["usernameFromEnv"] in env and trigger["authenticationRef"]["name"] == "redroll-keda-redis"
        streams.add(meta["stream"])
    assert streams == {keys.requests, keys.requests_high}
    auth = docs["TriggerAuthentication/redroll-keda-redis"]["spec"]["secretTargetRef"]
    assert auth == [{"parameter": "password", "name": "redroll-redis", "key": "worker"}]
    lanes = docs["ScaledObject/redroll-engine-worker-lanes"]
    assert lanes["spec"]["scaleTargetRef"]["name"] == "redroll-engine-worker" and lanes["spec"]["minReplicaCount"] == 0
    (trigger,) = lanes["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and 'job="redroll-exporter"' in trigger["metadata"]["query"]
    exporter = docs["Deployment/redroll-exporter"]["spec"]["template"]["spec"]["containers"][0]
    build_parser().parse_args(exporter["command"][1:])


def keda_replicas(scaled: dict, metrics: list[float]) -> int:
    """The replica count KEDA (with the HPA it drives) settles on for ``scaled`` when its triggers
    read ``metrics``: every trigger inactive (its metric not above its activation threshold, 0 by
    default) → minReplicaCount once the cooldown passed; else the largest ceil(metric / target)
    over the triggers (metric type AverageValue, KEDA's default; KEDA takes the maximum), at least
    1, within minReplicaCount and maxReplicaCount."""
    spec = scaled["spec"]
    targets, activations = [], []
    for trigger in spec["triggers"]:
        meta = trigger["metadata"]
        if trigger["type"] == "redis-streams":
            targets.append(float(meta.get("streamLength") or meta.get("pendingEntriesCount") or meta["lagCount"]))
            activations.append(float(meta.get("activationLagCount", 0)))
        else:
            targets.append(float(meta["threshold"]))
            activations.append(float(meta.get("activationThreshold", 0)))
    low, high = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
    if not any(m > a for m, a in zip(metrics, activations)):
        return low
    desired = max(math.ceil(m / t) for m, t in zip(metrics, targets))
    return min(high, max(desired, 1, low))


async def redis_streams_metric(r, trigger: dict) -> float:
    """What KEDA's redis-streams scaler reads for ``trigger``: XLEN without a consumerGroup, else
    XPENDING's count (``pendingEntriesCount``) or the group's lag (``lagCount``)."""
    meta = trigger["metadata"]
    if "consumerGroup" not in meta:
        return float(await r.xlen(meta["stream"]))
    if "lagCount" in meta:
        groups = await r.xinfo_groups(meta["stream"])
        return float(next(g["lag"] for g in groups if g["name"].decode() == meta["consumerGroup"]))
    return float((await r.xpending(meta["stream"], meta["consumerGroup"]))["pending"])


async def test_keda_scales_from_zero_on_a_backlog_no_worker_could_report(settings, r, tmp_path):
    """No worker alive: the ScaledObjects' metrics (XLEN of the request streams; the exporter's
    backlog and in-flight gauges with affinity lanes) still show a backlog, so KEDA's count goes
    from 0 to at least 1 — and back to 0 once nothing is queued or running."""
    pytest.importorskip("prometheus_client")
    from redroll.producer.client import make_request, send
    from redroll.shared.lanes import set_lanes
    from tests.test_exporter import exported

    docs = manifests()
    scaled, lanes = docs["ScaledObject/redroll-engine-worker"], docs["ScaledObject/redroll-engine-worker-lanes"]
    # The manifests name the pipeline "{redroll}"; here it is the test's namespace.
    triggers = [{**t, "metadata": {**t["metadata"], "stream": t["metadata"]["stream"].replace(
        "{redroll}", settings.keys.tag)}} for t in scaled["spec"]["triggers"]]

    async def streams_replicas() -> int:
        return keda_replicas(scaled, [await redis_streams_metric(r, t) for t in triggers])

    assert await streams_replicas() == 0  # (nothing queued: zero workers)
    await send(settings, r, [make_request(request_id=f"q-{i}", input_ids=[1]) for i in range(300)])
    assert await streams_replicas() == 2  # (300 queued, 256 a worker)
    await r.delete(settings.keys.requests)
    await send(settings, r, [make_request(request_id="hi", input_ids=[1], priority=1)])
    assert await streams_replicas() == 1  # (one high-priority request wakes the fleet)

    # With affinity lanes: requests wait in lane streams; the exporter reads them with no worker alive.
    s = settings.with_(affinity_lanes=4, namespace=settings.namespace + "-lanes")
    await set_lanes(r, s.keys, s.partition_keys, 4)
    await send(s, r, [make_request(request_id=f"l-{i}", input_ids=[1], affinity_key=f"session-{i}") for i in range(5)])
    got = await exported(s, tmp_path / "exporter.log", "--affinity-lanes", "4")
    # The trigger's query: sum(backlog) + sum(in flight), over the exporter's series.
    metric = sum(v for (name, _), v in got.items() if name in ("redroll_pipeline_backlog", "redroll_pipeline_in_flight"))
    assert got[("redroll_pipeline_workers_alive", ())] == 0 and metric == 5
    assert got[("redroll_pipeline_backlog", (("priority", "lanes"),))] == 5
    assert keda_replicas(lanes, [metric]) == 1 and keda_replicas(lanes, [0.0]) == 0
