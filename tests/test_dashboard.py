"""`redroll dashboard`: the page in a real headless browser over a frozen fleet, and its API without one.

The browser test starts two synthetic workers as processes, lets them finish some requests and hold
others, then freezes them (SIGSTOP) so nothing moves, and checks that what the page shows equals
`redroll status --json`; after thawing them it requeues a dead letter from the page (click, confirm)
and waits for that request's record. The API tests check the JSON endpoints and the refusals of the
actions that change state (403 when disabled, 401 without the token), without a browser.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from redroll.ops.status import collect_pipeline_status
from redroll.producer.client import make_request, send
from redroll.shared.codec import encode_request
from tests.conftest import spawn, stop_process, wait_until
from tests.test_security import acl_server, admin  # noqa: F401  (fixtures: a server with ACL users)

pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

TOKEN = "t0ken-for-the-dashboard-tests-0123456789"


def dead_request_fields(request_id: str, reason: str = "delivered 3 times (max_deliveries 3): the worker died") -> dict:
    """A dead letter of a valid request (as a worker writes one after too many deliveries)."""
    fields = encode_request(make_request(request_id=request_id, prompt="x", sampling_params={"max_new_tokens": 4}))
    return {"reason": reason, "source": "worker", "entry": "1-0", "deliveries": "3", **fields}


def client_for(r, settings, **kw):
    from redroll.web.dashboard.app import create_app

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
    from redroll.web.dashboard.app import Actions

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
        response = await client.post("/api/dead/purge", json={"ids": ["1-0", "drop table"]}, headers=auth)
        assert response.status_code == 400 and "$.ids[1]" in one_line_error(response)
        response = await client.post("/api/dead/purge", json={"ids": []}, headers=auth)
        assert response.status_code == 400 and one_line_error(response).startswith("ids:")
        response = await client.post("/api/dead/requeue", json={"ids": ["9-9"]}, headers=auth)
        assert response.json() == {"requeued": [], "refused": ["9-9: no such dead letter"]}
        response = await client.post("/api/dead/purge", json=body, headers=auth)
        assert response.status_code == 200 and response.json() == {"purged": 1}
    assert await r.xlen(keys.dead) == 0


async def test_request_lookup_metrics_and_host_check(settings, r, monkeypatch):
    pytest.importorskip("prometheus_client")
    from redroll.web.dashboard.app import LOOPBACK_HOSTS
    from tests.test_exporter import parse

    await send(settings, r, [make_request(request_id="q-1", prompt="x")])
    monkeypatch.setitem(sys.modules, "redroll.ops.trace", None)  # (the module missing: import fails)
    async with client_for(r, settings, allowed_hosts=list(LOOPBACK_HOSTS)) as client:
        response = await client.get("/api/request/q-1")
        assert response.status_code == 501 and "redroll.ops.trace" in one_line_error(response)
        metrics = await client.get("/metrics")
        assert metrics.status_code == 200
        assert parse(metrics.text)[("redroll_pipeline_backlog", (("priority", "normal"),))] == 1
        assert (await client.get("/api/status", headers={"Host": "evil.example"})).status_code == 400
        for host in ("localhost:8470", "127.0.0.1:8470", "[::1]:8470"):
            assert (await client.get("/api/status", headers={"Host": host})).status_code == 200, host


async def test_request_lookup_is_redroll_trace_and_redis_down_is_503(settings, r):
    from redroll.shared.connection import connect
    from redroll.testing.embedded import free_port

    (entry_id,) = await send(settings, r, [make_request(request_id="q-2", prompt="x")])
    async with client_for(r, settings) as client:
        queued = (await client.get("/api/request/q-2")).json()
        unknown = await client.get("/api/request/never-submitted")
    # The document of `redroll trace --json`, with the steps the page draws.
    assert queued["request_id"] == "q-2" and queued["now"]["queued_entry"] == entry_id
    assert queued["submitted"]["entry"] == entry_id and queued["gaps"] == []
    assert [s["step"] for s in queued["steps"]] == ["submitted"]
    assert entry_id in queued["steps"][0]["what"] and queued["steps"][0]["at"] == int(entry_id.split("-")[0]) / 1000
    assert unknown.status_code == 200 and unknown.json()["steps"] == []
    assert "no event log for 'never-submitted'" in unknown.json()["gaps"][0]
    down = connect(settings.with_(redis_url=f"redis://127.0.0.1:{free_port()}"))
    try:
        async with client_for(down, settings) as client:
            response = await client.get("/api/status")
        assert response.status_code == 503 and one_line_error(response).startswith("redis: ")
    finally:
        await down.aclose()


async def test_operator_user_reads_everything_and_writes_nothing(acl_server, admin, namespace):  # noqa: F811
    """The dashboard's reads need no more than the operator ACL role; its actions need the administrator."""
    pytest.importorskip("prometheus_client")
    from redis.asyncio import Redis

    from redroll.shared.connection import connect
    from redroll.web.dashboard.app import Actions
    from tests.test_security import ADMIN_PASSWORD, acl_denials, make_user

    operator = make_user(admin, acl_server, namespace, "operator")
    entry_id = admin.xadd(operator.keys.dead, dead_request_fields("dead-3")).decode()
    admin.hset(operator.keys.weights, mapping={"weight_version": "v1"})
    op = connect(operator)
    boss = Redis(port=acl_server.port, username="admin", password=ADMIN_PASSWORD)
    try:
        async with client_for(op, operator, actions=Actions(op, operator, TOKEN)) as client:
            for path in ("/", "/api/status", "/api/weights", "/api/dead", "/metrics"):
                assert (await client.get(path)).status_code == 200, path
            assert acl_denials(admin, namespace) == []
            auth = {"Authorization": f"Bearer {TOKEN}"}
            response = await client.post("/api/dead/purge", json={"ids": [entry_id]}, headers=auth)
            assert response.status_code == 503 and "no permissions" in one_line_error(response)
        async with client_for(op, operator, actions=Actions(boss, operator, TOKEN)) as client:
            response = await client.post("/api/dead/purge", json={"ids": [entry_id]}, headers=auth)
            assert response.json() == {"purged": 1}
    finally:
        await op.aclose()
        await boss.aclose()


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


# The browser test ------------------------------------------------------------------------------

PAGE_FIGURES = r"""
const text = (id) => document.getElementById(id).textContent;
const ids = ["queued-total", "queued-normal", "queued-high", "queued-lanes", "inflight-normal", "inflight-high",
             "inflight-lanes", "results-length", "dead-count", "workers-alive", "workers-stale", "rate-finished",
             "rate-tokens", "rate-finished-1m", "rate-tokens-1m", "weights-desired", "weights-old"];
const cells = (tr) => Object.fromEntries([...tr.querySelectorAll("td[data-col]")].map((td) => [td.dataset.col,
                                                                                               td.textContent]));
return {
  time: document.getElementById("snapshot-time").dataset.time,
  figures: Object.fromEntries(ids.map((id) => [id, text(id)])),
  alerts: [...document.querySelectorAll("#alerts li")].map((li) => [li.className, li.textContent]),
  groups: Object.fromEntries([...document.querySelectorAll("#groups tbody tr")].map((tr) => [tr.dataset.group,
                                                                                            cells(tr)])),
  workers: Object.fromEntries([...document.querySelectorAll("#workers tbody tr")].map((tr) => [tr.dataset.worker,
    Object.assign(cells(tr), {seen: tr.querySelector("td[data-col=seen]").dataset.seen})])),
  versions: Object.fromEntries([...document.querySelectorAll("#versions tbody tr")].map((tr) => [tr.dataset.version,
                                                                                                cells(tr).workers])),
  dead: [...document.querySelectorAll("#dead tbody tr")].map((tr) => tr.dataset.dead),
};
"""


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.fail("the dashboard test needs Debian's chromium and chromium-driver: apt-get install -y chromium "
                    "chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,2400"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=driver), options=options)


@pytest.fixture(scope="module")
def chrome():
    """One headless Chromium for the module's browser tests."""
    driver = browser()
    yield driver
    driver.quit()


def expected_page(doc: dict, desired: str) -> dict:
    """What the page must show for the status document ``doc`` (the desired weight version ``desired``)."""
    lanes = doc.get("lanes") or {"backlog": 0, "pending": 0}
    live = [w for w in doc["workers"] if w["alive"]]
    versions: dict[str, str] = {}
    for w in live:
        versions[str(w["weight_version"])] = str(sum(1 for x in live if x["weight_version"] == w["weight_version"]))
    return {
        "figures": {"queued-total": str(doc["queued_total"]), "queued-normal": str(doc["requests"]["backlog"]),
                    "queued-high": str(doc["requests_high"]["backlog"]), "queued-lanes": str(lanes["backlog"]),
                    "inflight-normal": str(doc["requests"]["pending"]),
                    "inflight-high": str(doc["requests_high"]["pending"]), "inflight-lanes": str(lanes["pending"]),
                    "results-length": str(doc["results"]["length"]), "dead-count": str(doc["dead_letters"]),
                    "workers-alive": str(doc["workers_alive"]), "workers-stale": str(doc["workers_stale"]),
                    "weights-desired": desired,
                    "weights-old": str(sum(1 for w in live if str(w["weight_version"]) != desired))},
        "alerts": [["alert", a] for a in doc["alerts"]] + [["warning", w] for w in doc["warnings"]],
        "groups": {g["group"]: {"group": g["group"], "consumers": str(g["consumers"]), "pending": str(g["pending"]),
                                "lag": str(g["backlog"])} for g in doc["results"]["groups"]},
        "workers": {w["name"]: {"host": w["host"], "engine": w["engine"], "model": w["model"],
                                "state": w["state"] if w["alive"] else f"stale (last: {w['state']})",
                                "weight_version": str(w["weight_version"]),
                                "inflight": f"{w['inflight']} / {w['max_inflight']}"} for w in doc["workers"]},
        "versions": versions,
    }


async def dashboard_url(log: Path) -> str:
    found: list[str] = []

    def printed() -> bool:
        match = re.search(r"redroll dashboard: (http://\S+)", log.read_text() if log.exists() else "")
        if match:
            found.append(match.group(1))
        return bool(match)

    await wait_until(printed, timeout=60)
    return found[0]


@pytest.mark.slow
async def test_page_in_a_browser_equals_status_and_requeues_a_dead_letter(settings, r, tmp_path, chrome):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    from redroll.ops.control import send_abort
    from redroll.shared.keys import WORKERS_GROUP
    from tests.test_cli import run_cli

    keys = settings.keys
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    dash_log = tmp_path / "dashboard.log"
    dashboard = spawn(settings, "dashboard", "--port", "0", "--interval", "0.5", "--allow-actions",
                      "--admin-url", settings.redis_url, "--token-file", str(token_file), log=dash_log)
    workers = [spawn(settings, "worker", "--engine", "synthetic", "--token-ms", "5", "--max-inflight", "2",
                     "--name", f"w{i}", "--weight-version", "v1", log=tmp_path / f"w{i}.log") for i in range(2)]
    driver = chrome
    frozen = False
    try:
        driver.get(await dashboard_url(dash_log))

        async def published(n: int) -> bool:
            status = await collect_pipeline_status(r, keys, settings.partition_keys)
            return sum(w.get("published", 0) for w in status["workers"] if w["alive"]) >= n

        # Work done: six finished requests and a dead letter (a request that is not msgpack).
        await send(settings, r, [make_request(request_id=f"done-{i}", prompt="x", sampling_params={"max_new_tokens": 8})
                                 for i in range(6)])
        await r.xadd(keys.requests, {"rid": "bad-1", "data": b"\xc1"})
        await wait_until(lambda: published(6), timeout=60)
        await wait_until(lambda: r.xlen(keys.dead), timeout=30)
        # Work held: two long requests in flight on each worker, then four queued behind them.
        long_ids = [f"long-{i}" for i in range(4)]
        await send(settings, r, [make_request(request_id=x, prompt="x", sampling_params={"max_new_tokens": 30_000})
                                 for x in long_ids])

        async def all_in_flight() -> bool:
            beats = [json.loads(v) for v in (await r.hgetall(keys.workers)).values()]
            pending = int((await r.xpending(keys.requests, WORKERS_GROUP))["pending"])
            return pending == 4 and len(beats) == 2 and all(b["inflight"] == 2 for b in beats)

        await wait_until(all_in_flight, timeout=30)
        await send(settings, r, [make_request(request_id=f"queued-{i}", prompt="x") for i in range(3)])
        await send(settings, r, [make_request(request_id="urgent", prompt="x", priority=1)])
        revive_id = (await r.xadd(keys.dead, dead_request_fields("revive-1"))).decode()
        await r.xgroup_create(keys.results, "trainer", id="0")  # a group that reads nothing: its lag is every record
        for w in workers:
            w.send_signal(signal.SIGSTOP)
        frozen = True
        await r.hset(keys.weights, mapping={"weight_version": "v2", "model_path": "/ckpt/v2"})

        # The page equals `redroll status --json` read while nothing moves. (Only the heartbeats' ages
        # grow: a read on each side of the moment the workers turn stale is taken again.)
        for attempt in range(3):
            doc = json.loads(run_cli(settings, "status", "--json").stdout)
            shown: dict = {}

            def caught_up() -> bool:
                shown.update(driver.execute_script(PAGE_FIGURES))
                return bool(shown["time"]) and float(shown["time"]) > doc["time"]

            await wait_until(caught_up, timeout=30, interval=0.2)
            if shown["figures"]["workers-alive"] == str(doc["workers_alive"]):
                break
        want = expected_page(doc, "v2")
        assert doc["queued_total"] == 4 and doc["requests"]["pending"] == 4 and doc["dead_letters"] == 2
        assert doc["results"]["length"] >= 6 and doc["results"]["groups"][0]["backlog"] == doc["results"]["length"]
        for rate in ("rate-finished-1m", "rate-tokens-1m"):
            key = "requests_per_s" if "finished" in rate else "tokens_per_s"
            assert abs(float(shown["figures"].pop(rate)) - doc["rates_1m"][key]) <= 0.05
        for rate in ("rate-finished", "rate-tokens"):
            assert float(shown["figures"].pop(rate)) >= 0
        assert shown["figures"] == want["figures"]
        assert shown["alerts"] == want["alerts"]
        assert shown["groups"] == want["groups"]
        assert shown["versions"] == want["versions"]
        assert set(shown["workers"]) == set(want["workers"]) == {"w0", "w1"}
        for name, row in shown["workers"].items():
            assert {k: row[k] for k in want["workers"][name]} == want["workers"][name]
            assert float(row["seen"]) == next(w["seen"] for w in doc["workers"] if w["name"] == name)
        assert set(shown["dead"]) == {e.decode() for e, _ in await r.xrange(keys.dead)}
        # An alert: the control stream replaced by a string refuses every write; the page says what status says.
        await r.set(keys.control, "not a stream")
        alerts = (await collect_pipeline_status(r, keys, settings.partition_keys))["alerts"]
        assert any("WRONGTYPE" in a for a in alerts)
        await wait_until(lambda: [a for kind, a in driver.execute_script(PAGE_FIGURES)["alerts"] if kind == "alert"]
                         == alerts, timeout=30, interval=0.2)
        # A request looked up by its id: the steps redroll trace prints (queued-0 waits in its entry).
        queued_entry = (await r.get(keys.rid("queued-0"))).decode().split()[-1]
        driver.find_element(By.ID, "lookup-id").send_keys("queued-0")
        driver.find_element(By.CSS_SELECTOR, "#lookup button").click()
        await wait_until(lambda: driver.find_elements(By.CSS_SELECTOR, "#timeline tbody tr"), timeout=30)
        cells = [c.text for c in driver.find_elements(By.CSS_SELECTOR, "#timeline tbody td")]
        assert cells[1] == "submitted" and queued_entry in cells[2] and cells[0].count(":") == 2
        screenshot = tmp_path / "dashboard.png"
        driver.set_window_size(1400, driver.execute_script("return document.documentElement.scrollHeight") + 40)
        driver.save_screenshot(str(screenshot))
        print(f"\ndashboard screenshot: {screenshot}")

        # Thawed, with the long requests aborted: the dead letter requeued from the page runs.
        await r.delete(keys.weights, keys.control)
        for w in workers:
            w.send_signal(signal.SIGCONT)
        frozen = False
        await send_abort(r, keys, long_ids)
        driver.find_element(By.ID, "token").send_keys(TOKEN)
        row = driver.find_element(By.CSS_SELECTOR, f'tr[data-dead="{revive_id}"]')
        row.find_element(By.CSS_SELECTOR, "button.purge").click()
        WebDriverWait(driver, 30).until(expected_conditions.alert_is_present()).dismiss()  # (nothing happens)
        row.find_element(By.CSS_SELECTOR, "button.requeue").click()
        alert = WebDriverWait(driver, 30).until(expected_conditions.alert_is_present())
        assert revive_id in alert.text and "revive-1" in alert.text
        alert.accept()
        await wait_until(lambda: driver.find_element(By.ID, "action-result").text == "requeued 1", timeout=30)

        async def revived() -> bool:
            return any(f.get(b"rid") == b"revive-1" for _, f in await r.xrange(keys.results))

        await wait_until(revived, timeout=60)
        # Requeued, it left the dead letters; the purge that was not confirmed removed nothing.
        assert [f[b"rid"] for _, f in await r.xrange(keys.dead)] == [b"bad-1"]
    finally:
        for w in workers:
            if frozen:
                w.send_signal(signal.SIGCONT)
            stop_process(w)
        stop_process(dashboard)


@pytest.mark.slow
async def test_page_shows_partitions_lanes_and_worker_states_as_status_does(settings, r, tmp_path, chrome):
    """A partitioned pipeline with affinity lanes, no worker process: heartbeats written with a
    time ahead (they stay fresh), so the figures hold still while the page is read."""
    from redroll.shared.lanes import set_lanes

    s = settings.with_(partitions=2, affinity_lanes=2)
    keys, parts = s.keys, s.partition_keys
    await set_lanes(r, keys, parts, 2)
    await send(s, r, [make_request(request_id=f"p-{i}", prompt="x") for i in range(4)])
    await send(s, r, [make_request(request_id=f"l-{i}", prompt="x", affinity_key=f"k{i}") for i in range(3)])
    await r.xgroup_create(parts[0].results, "billing", id="0", mkstream=True)
    await r.hset(keys.weights, mapping={"model_path": "/w/v2", "weight_version": "v2"})
    ahead = time.time() + 120
    beats = {"w-run": ("running", "v2", [0]), "w-drain": ("draining", "v1", []),
             "w-blocked": ("blocked", "v2", [1]), "w-await": ("awaiting_weights", "v1", [])}
    for name, (state, version, lanes) in beats.items():
        beat = {"host": "h1", "engine": "synthetic", "model": "m", "weight_version": version, "state": state,
                "inflight": 1, "max_inflight": 8, "seen": ahead, "published": 5, "tokens": 40, "lanes": lanes}
        if state == "blocked":
            beat["blocked"] = {parts[1].results: "OOM command not allowed when used memory > 'maxmemory'"}
        await r.hset(keys.workers, name, json.dumps(beat))
    log = tmp_path / "dashboard.log"
    dashboard = spawn(settings, "dashboard", "--port", "0", "--interval", "0.5", log=log, REDROLL_PARTITIONS="2",
                      REDROLL_AFFINITY_LANES="2")
    try:
        chrome.get(await dashboard_url(log))
        doc = await collect_pipeline_status(r, keys, parts)
        shown: dict = {}

        def caught_up() -> bool:
            shown.update(chrome.execute_script(PAGE_FIGURES))
            return bool(shown["time"]) and float(shown["time"]) > doc["time"]

        await wait_until(caught_up, timeout=30, interval=0.2)
        tables = chrome.execute_script(TABLES)
    finally:
        stop_process(dashboard)
    want = expected_page(doc, "v2")
    assert doc["queued_total"] == 7 and doc["lanes"]["backlog"] == 3 and len(doc["partitions"]) == 2
    assert shown["figures"]["queued-lanes"] == "3" and shown["figures"]["weights-old"] == "2"
    for rate in ("rate-finished", "rate-tokens", "rate-finished-1m", "rate-tokens-1m"):
        shown["figures"].pop(rate)
    assert shown["figures"] == want["figures"]
    assert shown["alerts"] == want["alerts"] and any("w-blocked is blocked" in a for _, a in shown["alerts"])
    assert shown["groups"] == want["groups"] and shown["versions"] == want["versions"] == {"v1": "2", "v2": "2"}
    for name, row in shown["workers"].items():
        assert {k: row[k] for k in want["workers"][name]} == want["workers"][name]
        assert row["lanes"] == (", ".join(str(j) for j in beats[name][2]) or "-")
    assert tables["lanes"] == [[lane["stream"], str(lane["backlog"]), str(lane["pending"]), lane["owner"] or "-"]
                               for lane in doc["lanes"]["per_lane"]]
    assert tables["partitions"] == [[p["tag"], p["node"] or "-", str(p["queued"]), str(p["in_flight"]),
                                     str(p["results"]), str(p["dead_letters"])] for p in doc["partitions"]]


TABLES = r"""
const rows = (id) => [...document.querySelectorAll("#" + id + " tbody tr")].map((tr) =>
  [...tr.querySelectorAll("td")].map((td) => td.textContent));
return {lanes: rows("lanes"), partitions: rows("partitions")};
"""
