"""The command line as an operator uses it: demo, submit, status, abort, compose.yaml."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from redroll.cli.main import build_parser
from tests.conftest import ROOT, redroll_env, spawn, wait_until


def run_cli(settings, *args: str, timeout: float = 120, input: str | None = None, **env: str):
    return subprocess.run([sys.executable, "-m", "redroll.cli", *args], cwd=ROOT, env=redroll_env(settings, **env),
                          capture_output=True, text=True, timeout=timeout, input=input)


@pytest.mark.slow
def test_demo_on_embedded_default_prints_completions():
    """The README's first command: no REDROLL_REDIS_URL, the demo brings its own server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDROLL_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "redroll.cli", "demo"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    completions = re.findall(r"^\[demo-\d+\] finished", proc.stdout, re.M)
    assert len(completions) >= 4, proc.stdout
    assert "awaited record: finished" in proc.stdout


def test_demo_fakeredis_fallback(tmp_path):
    """Without any redis-server on PATH the demo runs on in-process fakeredis."""
    bindir = tmp_path / "bin"  # an empty PATH: no redis-server, no valkey-server
    bindir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDROLL_")}
    env.update(PATH=str(bindir), PYTHONPATH=str(ROOT))
    # sys.executable itself, not a link to it: a link outside a virtualenv's bin/ loses the venv.
    proc = subprocess.run([sys.executable, "-m", "redroll.cli", "demo", "--engine", "synthetic"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fakeredis" in proc.stdout
    assert len(re.findall(r"^\[demo-\d+\] finished", proc.stdout, re.M)) == 4
    # Asked for by name, the synthetic engine is not offered as a stand-in for a missing torch.
    assert "synthetic engine (token ids without a model" in proc.stdout
    if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
        assert "install redroll[cpu]" not in proc.stdout


@pytest.mark.slow
def test_submit_wait_writes_records(settings, tmp_path):
    worker = spawn(settings, "worker", "--engine", "synthetic", "--max-inflight", "8")
    try:
        src = tmp_path / "in.jsonl"
        lines = [{"request_id": f"job-{i}", "prompt": f"p{i}", "sampling_params": {"max_new_tokens": 4, "n": 2},
                  "return_logprob": True, "meta_info": {"i": i}} for i in range(20)]
        lines.append({"request_id": "job-ids", "input_ids": [1, 2, 3]})
        src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
        out = tmp_path / "out.jsonl"
        proc = run_cli(settings, "submit", str(src), "--wait", "--out", str(out), "--timeout", "60")
        assert proc.returncode == 0, proc.stderr
        records = [json.loads(x) for x in out.read_text().splitlines()]
        assert sorted(r["request_id"] for r in records) == sorted(x["request_id"] for x in lines)
        for rec in records:
            assert rec["status"] == "finished"
            if rec["request_id"] != "job-ids":
                assert len(rec["output_token_ids"]) == 2
                assert [len(x) for x in rec["output_token_ids"]] == [len(x) for x in rec["output_logprobs"]]
                assert rec["meta_info"]["i"] == int(rec["request_id"].split("-")[1])
    finally:
        worker.terminate()
        assert worker.wait(20) == 0


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill"])
async def test_an_interrupted_submit_keeps_what_came_says_what_did_not_and_resumes(settings, r, tmp_path, stop):
    """Ctrl-C writes what came and says what did not; a kill says nothing, and may catch a batch
    between its arrival and its write: it was not acked yet, so the resume writes it."""
    worker = spawn(settings, "worker", "--engine", "synthetic", "--token-ms", "20", "--max-inflight", "4")
    try:
        src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        src.write_text("".join(json.dumps({"request_id": f"i-{i}", "prompt": "x", "sampling_params":
                                           {"max_new_tokens": 10}}) + "\n" for i in range(40)))
        submit = [sys.executable, "-m", "redroll.cli", "submit", str(src), "--wait", "--out", str(out), "--no-progress"]
        # (SIGINT handled as under a terminal: a suite started in the background, by a non-interactive
        # shell's `&`, hands it down ignored, and the Ctrl-C would do nothing)
        proc = subprocess.Popen(submit, cwd=ROOT, env=redroll_env(settings), stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 60
        while (len(out.read_bytes().splitlines()) if out.exists() else 0) < 8:
            assert time.monotonic() < deadline and proc.poll() is None
            await asyncio.sleep(0.05)
        proc.send_signal(stop)
        _, err = proc.communicate(timeout=30)
        written = [json.loads(line)["request_id"] for line in out.read_text().splitlines()]  # (whole lines only)
        assert len(set(written)) == len(written)
        if stop == signal.SIGINT:
            assert proc.returncode == 130 and "Traceback" not in err
            said = re.search(r"interrupted: (\d+) submitted request\(s\) have no record yet.*?(\d+) request\(s\) "
                             r"were not submitted", err)
            assert said, err
            assert len(written) + int(said[1]) + int(said[2]) == 40
            assert "{" + settings.namespace + "}:reply:producer-" in err and "with --resume takes them over" in err, err
        else:
            assert proc.returncode == -signal.SIGKILL
        # The same command with --resume: every record once, and no request generated twice.
        resumed = run_cli(settings, *submit[3:], "--resume", timeout=60)
        assert resumed.returncode == 0, resumed.stderr
        assert f"resuming {out}: {len(written)} record(s) there" in resumed.stderr
        lines = [json.loads(line)["request_id"] for line in out.read_text().splitlines()]
        assert sorted(lines) == sorted(f"i-{i}" for i in range(40)) and lines[:len(written)] == written

        async def published() -> int:
            return sum(json.loads(v)["published"] for v in (await r.hgetall(settings.keys.workers)).values())

        await wait_until(lambda: _at_least(published, 40), timeout=10)
        await asyncio.sleep(3 * settings.heartbeat_s)
        assert await published() == 40
    finally:
        worker.terminate()
        assert worker.wait(20) == 0


async def _at_least(count, n: int) -> bool:
    return await count() >= n


def test_submit_refuses_bad_file_and_sends_nothing(settings, tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"request_id": "ok", "prompt": "x"}\n{"request_id": "bad", "prompt": "x", '
                   '"sampling_params": {"temperature": -1}}\n')
    proc = run_cli(settings, "submit", str(src))
    assert proc.returncode == 2
    assert "bad.jsonl:2" in proc.stderr and "temperature" in proc.stderr
    status = json.loads(run_cli(settings, "status", "--json").stdout)
    assert status["requests"]["length"] == 0


async def test_status_json_and_abort(settings, r):
    proc = run_cli(settings, "submit", "-", input="\n".join(
        json.dumps({"request_id": f"q-{i}", "prompt": "x"}) for i in range(3)))
    assert proc.returncode == 0, proc.stderr
    status = json.loads(run_cli(settings, "status", "--json").stdout)
    assert status["requests"]["length"] == 3 and status["requests"]["backlog"] == 3
    assert status["requests"]["pending"] == 0 and status["workers"] == []
    assert status["dead_letters"] == 0 and status["namespace"] == settings.namespace
    proc = run_cli(settings, "abort", "q-0", "--group", "g1")
    assert proc.returncode == 0, proc.stderr
    # q-0 is fire-and-forget (its record goes to the results stream, which no producer writes):
    # marked aborted, for the worker that reaches it to publish its aborted record; the group too.
    assert "0 cancelled while still queued" in proc.stdout
    assert await r.xlen(settings.keys.requests) == 3 and await r.xlen(settings.keys.results) == 0
    assert await r.zscore(settings.keys.aborted, "r:q-0") is not None
    assert await r.zscore(settings.keys.aborted, "g:g1") is not None
    human = run_cli(settings, "status")
    assert human.returncode == 0 and "queued" in human.stdout
    # --json --watch: JSON lines only, the first at once (a table was once mixed in)
    watch = subprocess.Popen([sys.executable, "-m", "redroll.cli", "status", "--json", "--watch", "--interval",
                              "0.2"], cwd=ROOT, env=redroll_env(settings), stdout=subprocess.PIPE, text=True)
    try:
        lines = [watch.stdout.readline() for _ in range(3)]  # type: ignore[union-attr]
    finally:
        watch.kill()
        watch.communicate()
    assert [json.loads(line)["requests"]["length"] for line in lines] == [3, 3, 3]


def test_unreachable_redis_is_one_clear_line(settings):
    proc = run_cli(settings, "status", "--json", REDROLL_REDIS_URL="redis://127.0.0.1:1/0")
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0
    assert "cannot reach redis at redis://127.0.0.1:1/0" in proc.stderr


@pytest.mark.parametrize("var, value, says", [
    ("REDROLL_CLAIM_IDLE_MS", "abc", "REDROLL_CLAIM_IDLE_MS='abc' is not a valid int"),
    ("REDROLL_REDIS_CLUSTER", "maybe", "is not a boolean"),
    ("REDROLL_RID_TTL_S", "0", "rid_ttl_s (REDROLL_RID_TTL_S) must be at least 1, got 0"),
])
def test_a_bad_setting_in_the_environment_is_one_clear_line(settings, var, value, says):
    proc = run_cli(settings, "status", timeout=30, **{var: value})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("redroll status: ") and says in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


@pytest.mark.parametrize("args, says", [
    (["--out", "x.jsonl"], "--out and --timeout need --wait"),
    (["--timeout", "5"], "--out and --timeout need --wait"),
    (["--wait", "--timeout", "0"], "must be more than 0 seconds"),
    (["--wait", "--timeout", "-3"], "must be more than 0 seconds"),
    (["--resume"], "--resume needs --wait and --out"),
    (["--wait", "--resume"], "--resume needs --wait and --out"),
])
def test_submit_refuses_options_that_would_do_nothing(settings, tmp_path, args, says):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"request_id": "a", "prompt": "x"}) + "\n")
    proc = run_cli(settings, "submit", str(src), *args, timeout=30)
    assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.parametrize("args, says", [
    (["status", "--watch", "--interval", "0"], "must be more than 0 seconds"),  # it used to spin
    (["status", "--interval", "nan"], "is not a number of seconds"),
    (["weights", "update", "--timeout", "-1"], "must be more than 0 seconds"),
    (["dead", "list", "--count", "0"], "0 is not positive"),
    (["dead", "purge", "--older-than", "-60"], "must be 0 seconds or more"),  # it used to purge every letter
    (["gc", "--idle-consumer-s", "-1"], "must be 0 seconds or more"),
    (["gc", "--stale-worker-s", "soon"], "is not a number of seconds"),
])
def test_refuses_numbers_out_of_range(capsys, args, says):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(args)
    assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_zero_seconds_is_a_valid_age():
    args = build_parser().parse_args(["dead", "purge", "--older-than", "0"])
    assert args.older_than == 0.0


def test_compose_is_valid_and_names_real_commands():
    spec = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = spec["services"]
    assert {"redis", "engine_worker_0", "engine_worker_1", "consumer"} <= set(services)
    assert "--appendonly" in services["redis"]["command"] and "yes" in services["redis"]["command"]
    worker = services["engine_worker_0"]
    gpus = []
    for name in ("engine_worker_0", "engine_worker_1"):
        # each worker its own GPU set: no replicas sharing one `count: 1` reservation
        assert "replicas" not in services[name].get("deploy", {})
        (gpu,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"] and "count" not in gpu
        gpus.append(tuple(re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", d) for d in gpu["device_ids"]))
    assert len(set(gpus)) == 2
    assert any(v.endswith(":/models:ro") for v in worker["volumes"])
    parser = build_parser()
    for name in ("engine_worker_0", "consumer"):
        cmd = [c for c in services[name]["command"]]
        assert cmd[0] == "redroll"
        # Substitute compose variables with their defaults, then let the real parser check the flags.
        argv = [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", c) for c in cmd[1:]]
        parser.parse_args(argv)
    assert "sglang" in worker["command"]
    handler = services["consumer"]["command"][-1]
    module, fn = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", handler).split("=", 1)[1].split(":")
    mod = __import__(module, fromlist=[fn])
    assert callable(getattr(mod, fn))


async def test_submit_and_lanes_with_affinity_lanes(settings, r):
    from redroll.shared.keys import lane_index

    env = {"REDROLL_AFFINITY_LANES": "4"}
    proc = run_cli(settings, "submit", "-", input="\n".join(
        json.dumps({"request_id": f"t-{i}", "prompt": "x", "affinity_key": "sess-1"}) for i in range(2)), **env)
    assert proc.returncode == 0, proc.stderr
    lane = settings.with_(affinity_lanes=4).keys.lane(lane_index("sess-1", 4))
    assert await r.xlen(lane) == 2
    shown = json.loads(run_cli(settings, "lanes", "show", "--json").stdout)  # L read from the pipeline
    assert shown["lanes"] == 4 and shown["backlog"] == 2
    assert [x["backlog"] for x in shown["per_lane"] if x["stream"] == lane] == [2]
    status = json.loads(run_cli(settings, "status", "--json").stdout)
    assert status["lanes"]["backlog"] == 2 and status["queued_total"] == 2
    # A process with another L refuses to start, naming the pipeline's.
    proc = run_cli(settings, "submit", "-", input=json.dumps({"request_id": "u", "prompt": "x"}),
                   REDROLL_AFFINITY_LANES="2")
    assert proc.returncode == 2 and "affinity_lanes=4" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli(settings, "lanes", "set", "8")
    assert proc.returncode == 1 and "still hold entries" in proc.stderr
    await r.delete(lane)
    proc = run_cli(settings, "lanes", "set", "8")
    assert proc.returncode == 0 and "4 -> 8" in proc.stdout
    assert await r.hget(settings.keys.config, "affinity_lanes") == b"8"


def test_consume_batch_bytes_bounds_reads_and_chunks(capsys):
    parser = build_parser()
    args = parser.parse_args(["consume", "--group", "g", "--default-handler", "m:f", "--batch-bytes", "4096"])
    assert args.batch_bytes == 4096 and args.batch == 128
    assert parser.parse_args(["consume", "--group", "g", "--default-handler", "m:f"]).batch_bytes == 1 << 20
    for bad in ("0", "-5", "1MB"):
        with pytest.raises(SystemExit):
            parser.parse_args(["consume", "--group", "g", "--default-handler", "m:f", "--batch-bytes", bad])
    assert "--batch-bytes" in capsys.readouterr().err
