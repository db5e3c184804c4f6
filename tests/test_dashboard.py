"""`redroll dashboard`: the page in a real headless browser over a frozen fleet, and its API without one.

The browser test starts two synthetic workers as processes, lets them finish some requests and hold
others, then freezes them (SIGSTOP) so nothing moves, and checks that what the page shows equals
`redroll status --json`; after thawing them it requeues a dead letter from the page (click, confirm)
and waits for that request's record. The API tests check the JSON endpoints and the refusals of the
actions that change state (403 when disabled, 401 without the token), without a browser.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from redroll.producer.client import make_request, send
from redroll.shared.codec import encode_request
from redroll.status import collect_pipeline_status
from tests.conftest import read_jsonl, spawn, stop_process, wait_until  # noqa: F401

pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

TOKEN = "t0ken-for-the-dashboard-tests-0123456789"


def dead_request_fields(request_id: str, reason: str = "delivered 3 times (max_deliveries 3): the worker died") -> dict:
    """A dead letter of a valid request (as a worker writes one after too many deliveries)."""
    fields = encode_request(make_request(request_id=request_id, prompt="x", sampling_params={"max_new_tokens": 4}))
    return {"reason": reason, "source": "worker", "entry": "1-0", "deliveries": "3", **fields}


def client_for(r, settings, **kw):
    from redroll.dashboard import create_app

    app = create_app(r, settings, **kw)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")


def one_line_error(response) -> str:
    message = response.json()["error"]
    assert message and "\n" not in message
    return message


async def test_status_endpoint_is_the_status_document(settings, r):
    keys = settings.keys
    await send(settings, r, [make_request(request_id=f"q-{i}", prompt="x") for i in range(3)])
    await r.xadd(keys.dead, dead_request_fields("dead-1"))
    await r.hset(keys.weights, mapping={"weight_version": "v7", "model_path": "/ckpt/7"})
    async with client_for(r, settings) as client:
        got = (await client.get("/api/status")).json()
        weights = (await client.get("/api/weights")).json()
        dead_list = (await client.get("/api/dead")).json()
        page = await client.get("/")
    want = await collect_pipeline_status(r, keys, settings.partition_keys)
    assert got["queued_total"] == 3 and got["dead_letters"] == 1
    assert {k: v for k, v in got.items() if k != "time"} == {k: v for k, v in want.items() if k != "time"}
    assert weights == {"desired": {"weight_version": "v7", "model_path": "/ckpt/7"}}
    assert [e["request_id"] for e in dead_list["entries"]] == ["dead-1"] and dead_list["actions"] is False
    assert page.status_code == 200 and settings.namespace in page.text and "/api/status" in page.text


async def test_actions_refused_when_disabled_and_without_the_token(settings, r):
    from redroll.dashboard import Actions

    keys = settings.keys
    entry_id = await r.xadd(keys.dead, dead_request_fields("dead-2"))
    body = {"ids": [entry_id.decode()]}
    async with client_for(r, settings) as client:  # no actions: 403, whatever the token
        for action in ("requeue", "purge"):
            response = await client.post(f"/api/dead/{action}", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
            assert response.status_code == 403 and "--allow-actions" in one_line_error(response)
    async with client_for(r, settings, actions=Actions(r, settings, TOKEN)) as client:
        for headers in ({}, {"Authorization": "Bearer wrong-token"}, {"Authorization": TOKEN}):
            response = await client.post("/api/dead/purge", json=body, headers=headers)
            assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
            assert "bearer token" in one_line_error(response)
        assert await r.xlen(keys.dead) == 1  # nothing was purged
        auth = {"Authorization": f"Bearer {TOKEN}"}
        response = await client.post("/api/dead/purge", json={"ids": "1-0"}, headers=auth)
        assert response.status_code == 400 and "$.ids" in one_line_error(response)
        response = await client.post("/api/dead/purge", json={"ids": []}, headers=auth)
        assert response.status_code == 400 and one_line_error(response).startswith("ids:")
        response = await client.post("/api/dead/requeue", json={"ids": ["9-9"]}, headers=auth)
        assert response.json() == {"requeued": [], "refused": ["9-9: no such dead letter"]}
        response = await client.post("/api/dead/purge", json=body, headers=auth)
        assert response.status_code == 200 and response.json() == {"purged": 1}
    assert await r.xlen(keys.dead) == 0


async def test_request_lookup_metrics_and_host_check(settings, r, monkeypatch):
    pytest.importorskip("prometheus_client")
    from redroll.dashboard import LOOPBACK_HOSTS
    from tests.test_exporter import parse

    await send(settings, r, [make_request(request_id="q-1", prompt="x")])
    monkeypatch.setitem(sys.modules, "redroll.trace", None)  # (the module missing: import fails)
    async with client_for(r, settings, allowed_hosts=list(LOOPBACK_HOSTS)) as client:
        response = await client.get("/api/request/q-1")
        assert response.status_code == 501 and "redroll.trace" in one_line_error(response)
        metrics = await client.get("/metrics")
        assert metrics.status_code == 200
        assert parse(metrics.text)[("redroll_pipeline_backlog", (("priority", "normal"),))] == 1
        assert (await client.get("/api/status", headers={"Host": "evil.example"})).status_code == 400
        assert (await client.get("/api/status", headers={"Host": "localhost:8470"})).status_code == 200


def test_cli_refuses_half_configured_actions(tmp_path, settings):
    from tests.test_cli import run_cli

    short = tmp_path / "short"
    short.write_text("abc\n")
    cases = [
        (["--token-file", str(short)], "--token-file only with --allow-actions"),
        (["--allow-actions", "--admin-url", settings.redis_url], "--allow-actions needs --token-file"),
        (["--allow-actions", "--token-file", str(short)], "needs administrator credentials"),
        (["--allow-actions", "--admin-url", settings.redis_url, "--token-file", str(short)], "at least 16"),
        (["--allow-actions", "--admin-url", settings.redis_url, "--token-file", str(tmp_path / "none")],
         "cannot read"),
    ]
    for flags, message in cases:
        proc = run_cli(settings, "dashboard", "--port", "0", *flags, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, (flags, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1
