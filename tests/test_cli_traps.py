"""The command line without traps: each test is one a new user fell into (issue 45)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import pytest

from redroll.cli.main import build_parser, main
from redroll.engine_worker.engines.registry import ENGINES
from tests.conftest import ROOT, redroll_env, stop_process


def run_cli(settings, *args: str, timeout: float = 60, drop: tuple[str, ...] = (), **env: str):
    environ = {k: v for k, v in redroll_env(settings, **env).items() if k not in drop}
    return subprocess.run([sys.executable, "-m", "redroll.cli", *args], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=timeout)


def one_line(proc: subprocess.CompletedProcess) -> str:
    err = proc.stderr.strip()
    assert "Traceback" not in err and err.count("\n") == 0, err
    return err


# ---------------------------------------------------------------- worker


def test_a_worker_without_an_engine_refuses_to_start_naming_the_choices(settings):
    """It used to run the synthetic engine (fake tokens) and ignore --model-path."""
    proc = run_cli(settings, "worker", "--model-path", str(ROOT), drop=("REDROLL_ENGINE",))
    assert proc.returncode == 2
    err = one_line(proc)
    assert "--engine" in err and "REDROLL_ENGINE" in err and all(engine in err for engine in ENGINES), err


def test_a_worker_with_an_unknown_engine_in_the_environment_refuses_too(settings):
    proc = run_cli(settings, "worker", REDROLL_ENGINE="sglangg")
    assert proc.returncode == 2 and "sglangg" in one_line(proc)


@pytest.mark.parametrize("engine", ["transformers", "sglang", "vllm"])
def test_a_missing_model_directory_is_named(settings, tmp_path, engine):
    """Instead of a Hugging Face Hub error about repo ids."""
    missing = tmp_path / "no-such-model"
    proc = run_cli(settings, "worker", "--engine", engine, "--model-path", str(missing))
    assert proc.returncode == 2
    assert one_line(proc) == f"redroll worker: no such model directory: {missing}"


def test_a_model_is_named_by_every_engine_that_loads_one_and_not_by_the_synthetic_one():
    """``--model-path`` had one default for every engine (tiny-random): ``--engine vllm`` without it
    failed naming a directory the user never gave."""
    from redroll.cli.worker import worker_refusal

    parser = build_parser()
    for argv in (["worker", "--engine", "transformers", "--model-path", "tiny-random"],
                 ["worker", "--engine", "transformers", "--model-path", "tiny-random:7"],
                 ["worker", "--engine", "synthetic", "--model-path", "/nowhere"],
                 ["worker", "--engine", "synthetic"],
                 ["worker", "--engine", "sglang", "--model-path", "Qwen/Qwen2.5-0.5B-Instruct"]):
        assert worker_refusal(parser.parse_args(argv)) is None, argv
    for engine in ("vllm", "sglang", "transformers"):
        said = worker_refusal(parser.parse_args(["worker", "--engine", engine]))
        assert said is not None and said.startswith(f"the {engine} engine needs --model-path"), said
        assert "tiny-random" not in said or engine == "transformers", said


@pytest.mark.parametrize("argv, said", [
    (["--engine", "transformers", "--model-path", "tiny-random", "--kv-cache-gib", "2"],
     "the transformers engine does not take --kv-cache-gib (vllm only)"),
    (["--engine", "vllm", "--model-path", "m/m", "--skip-tokenizer-init"],
     "the vllm engine does not take --skip-tokenizer-init (sglang only)"),
    (["--engine", "vllm", "--model-path", "m/m", "--dp-size", "2", "--sglang-arg", "a=1"],
     "the vllm engine does not take --dp-size (sglang only), --sglang-arg (sglang only)"),
    (["--engine", "synthetic", "--device", "cuda"], "the synthetic engine does not take --device (transformers only)"),
    (["--engine", "transformers", "--model-path", "tiny-random", "--engine-arg", "a=1"],
     "the transformers engine does not take --engine-arg (engines given as package.module:Class only)"),
])
def test_a_flag_given_to_an_engine_that_ignores_it_is_refused_naming_it(argv, said):
    """SGLang-only flags configured nothing on vLLM, silently (--skip-tokenizer-init, --dp-size, --sglang-arg)."""
    from redroll.cli.worker import worker_refusal

    assert worker_refusal(build_parser().parse_args(["worker", *argv])) == said


def test_generic_names_for_generic_settings_with_the_engines_own_spellings_kept():
    """--mem-fraction-static (SGLang's name) configured vLLM's gpu_memory_utilization."""
    from redroll.cli.engine_flags import engine_options
    from redroll.engine_worker.engines.registry import ENGINES
    from redroll.shared.settings import Settings

    parser = build_parser()
    settings = Settings()
    for flag in ("--memory-fraction", "--mem-fraction-static", "--gpu-memory-utilization"):
        args = parser.parse_args(["worker", "--engine", "vllm", "--model-path", "m/m", flag, "0.5",
                                  "--context-length", "2048", "--max-running-requests", "64"])
        options = engine_options(args, ENGINES["vllm"], settings)
        assert (options["gpu_memory_utilization"], options["max_model_len"], options["max_num_seqs"]) == (0.5, 2048, 64)
    args = parser.parse_args(["worker", "--engine", "sglang", "--model-path", "m/m", "--memory-fraction", "0.7",
                              "--context-length", "4096"])
    options = engine_options(args, ENGINES["sglang"], settings)
    assert (options["mem_fraction_static"], options["context_length"]) == (0.7, 4096)
    args = parser.parse_args(["worker", "--engine", "vllm", "--model-path", "m/m", "--no-prefix-caching"])
    assert engine_options(args, ENGINES["vllm"], settings)["enable_prefix_caching"] is False
    args = parser.parse_args(["worker", "--engine", "vllm", "--model-path", "m/m"])
    assert engine_options(args, ENGINES["vllm"], settings)["enable_prefix_caching"] is True


def test_fault_injection_flags_are_out_of_the_help_and_still_work():
    from redroll.cli.engine_flags import engine_options
    from redroll.shared.settings import Settings

    parser = build_parser()
    help_text = next(child for name, child in _parsers(parser) if name == "redroll worker").format_help()
    assert "--raise-marker" not in help_text and "--exit-marker" not in help_text
    assert "--max-running-requests" in help_text and "--memory-fraction" in help_text
    args = parser.parse_args(["worker", "--engine", "synthetic", "--raise-marker", "BOOM"])
    assert engine_options(args, ENGINES["synthetic"], Settings())["raise_marker"] == "BOOM"


def test_max_inflight_follows_the_engine_unless_given():
    """--max-inflight defaulted to 32 for every engine and capped the engine's declared capacity."""
    parser = build_parser()
    assert parser.parse_args(["worker", "--engine", "synthetic"]).max_inflight is None
    assert parser.parse_args(["worker", "--engine", "synthetic", "--max-inflight", "7"]).max_inflight == 7


# ---------------------------------------------------------------- drain


async def test_drain_of_an_unknown_worker_says_so_and_fails(settings, r):
    await r.hset(settings.keys.workers, "alive-1", json.dumps({"seen": time.time()}))
    await r.hset(settings.keys.workers, "dead-1", json.dumps({"seen": time.time() - 3600}))
    for name in ("nobody", "dead-1"):
        proc = run_cli(settings, "drain", name)
        assert proc.returncode == 1, proc.stdout
        err = one_line(proc)
        assert f"no live worker named {name}" in err and "alive-1" in err, err
        assert "drain sent" not in proc.stdout
    assert await r.xlen(settings.keys.control) == 0  # nothing sent
    proc = run_cli(settings, "drain", "alive-1")
    assert proc.returncode == 0 and "drain sent to alive-1" in proc.stdout, proc.stderr


# ---------------------------------------------------------------- consume


def test_a_handler_typo_is_one_line(settings):
    proc = run_cli(settings, "consume", "--group", "g", "--handler", "s=tests.handlers:apend_to_file")
    assert proc.returncode == 2
    err = one_line(proc)
    assert "tests.handlers:apend_to_file" in err and "apend_to_file" in err, err


def test_a_missing_handler_module_is_one_line(settings):
    proc = run_cli(settings, "consume", "--group", "g", "--handler", "s=no_such_module_here:fn")
    assert proc.returncode == 2 and "no_such_module_here" in one_line(proc)


def test_a_handler_module_in_the_current_directory_is_found(settings, tmp_path, monkeypatch, capsys):
    """As celery and rq do: the console script's sys.path does not hold the current directory."""
    (tmp_path / "my_handlers_in_cwd.py").write_text("def apply(record):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path), os.getcwd())])
    monkeypatch.setenv("REDROLL_REDIS_URL", settings.redis_url)
    monkeypatch.setattr("redroll.observability.logs.setup_logging", lambda *args: None)  # (the suite's logging stays as it is)
    # (a typo in the function's name: refused before connecting, and only once the module was found)
    assert main(["consume", "--group", "g", "--handler", "s=my_handlers_in_cwd:aply"]) == 2
    err = capsys.readouterr().err
    assert "my_handlers_in_cwd has no aply" in err, err


# ---------------------------------------------------------------- help


def _parsers(parser: argparse.ArgumentParser, name: str = "redroll"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                yield from _parsers(child, f"{name} {sub}")


def test_every_flag_has_help_and_shows_its_default():
    missing = [f"{name} {action.option_strings[0]}" for name, parser in _parsers(build_parser())
               for action in parser._actions
               if action.option_strings and not isinstance(action, argparse._HelpAction) and not action.help]
    assert not missing, missing
    worker = dict(_parsers(build_parser()))["redroll worker"]
    text = worker.format_help()
    said = " ".join(text.split())
    assert "--max-inflight" in text and "default: the engine's capacity" in said, said
    name = next(a for a in worker._actions if "--name" in a.option_strings)
    assert "worker's name" in name.help and "consumer" not in name.help


# ---------------------------------------------------------------- status --watch


def test_status_watch_piped_to_a_file_flushes_each_frame(settings, tmp_path):
    out = tmp_path / "status.txt"
    with open(out, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "redroll.cli", "status", "--watch", "--interval", "0.2"],
                                cwd=ROOT, env=redroll_env(settings, PYTHONUNBUFFERED=""), stdout=fh,
                                stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while out.read_text().count("redroll pipeline") < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop_process(proc)  # SIGTERM: what was printed is in the file
    text = out.read_text()
    assert text.count("redroll pipeline") >= 2, text
    assert "\x1b[" not in text  # plain frames, no cursor movement


# ---------------------------------------------------------------- submit


def test_submit_reports_every_bad_line_in_one_run(settings, tmp_path):
    src = tmp_path / "in.jsonl"
    lines = [{"request_id": "ok-1", "prompt": "x"}, {"request_id": "bad id", "prompt": "x"},
             {"request_id": "ok-2"}, {"request_id": "ok-1", "prompt": "y"}, {"prompt": "x", "promt": "y"}]
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    proc = run_cli(settings, "submit", str(src))
    assert proc.returncode == 2, proc.stdout
    assert "Traceback" not in proc.stderr
    for n in (2, 3, 4, 5):
        assert f"{src}:{n}: " in proc.stderr, proc.stderr
    assert f"{src}:1:" not in proc.stderr


def test_read_requests_names_at_most_twenty_bad_lines_and_counts_the_rest():
    from redroll.cli.batch_run import InputError, read_requests
    from redroll.shared.settings import Settings

    lines = [json.dumps({"request_id": f"r{i}", "prompt": "x", "sampling_params": {"n": 0}}) for i in range(25)]
    with pytest.raises(InputError) as caught:
        read_requests(lines, Settings(), source="f.jsonl")
    message = str(caught.value).splitlines()
    assert message[0].startswith("f.jsonl:1: ") and message[19].startswith("f.jsonl:20: ")
    assert message[20] == "and 5 more bad line(s)" and len(message) == 21


# ---------------------------------------------------------------- dead list


async def test_dead_list_fits_80_columns_one_line_a_row(settings, r):
    reason = "invalid sampling_params.max_new_tokens: 100000 out of range [0, 32768], " + "and more words " * 8
    for i in range(3):
        await r.xadd(settings.keys.dead, {"reason": reason, "source": "worker", "entry": f"{i + 1}-0",
                                          "deliveries": "1", "rid": f"a-rather-long-request-id-{i}-" + "x" * 40,
                                          "data": b"\xc1"})
    proc = run_cli(settings, "dead", "list", COLUMNS="80", LINES="40")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, proc.stdout
    rows = [line for line in lines if "worker" in line]
    assert len(rows) == 3 and all(line.rstrip().endswith("…") for line in rows), proc.stdout
    listed = json.loads(run_cli(settings, "dead", "list", "--json").stdout)
    assert [e["reason"] for e in listed] == [reason] * 3  # (whole in --json)


# ---------------------------------------------------------------- no live worker


async def test_submit_wait_without_a_live_worker_says_so_and_keeps_reporting(settings, tmp_path, monkeypatch, capsys):
    import redroll.cli.batch_run
    from redroll.cli.batch_run import submit_file

    monkeypatch.setattr(redroll.cli.batch_run, "QUIET_CHECK_S", 0.2)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"request_id": f"q-{i}", "prompt": "x"}) + "\n" for i in range(2)))
    code = await submit_file(settings, str(src), wait=True, out=str(tmp_path / "out.jsonl"), progress=True,
                             timeout=1.5)
    err = capsys.readouterr().err
    assert code != 0
    assert err.count("no live worker in namespace") == 1, err
    assert settings.namespace in err
    assert err.count("records 0/2") >= 3, err  # (progress goes on while nothing arrives)


async def test_status_warns_when_work_is_queued_and_no_worker_is_alive(settings, r):
    from redroll.producer.client import make_request, send

    proc = run_cli(settings, "status", "--json")
    assert not any("no live worker" in w for w in json.loads(proc.stdout)["warnings"])
    await send(settings, r, [make_request(request_id="lonely", prompt="x")])
    status = json.loads(run_cli(settings, "status", "--json").stdout)
    assert any("1 request(s) queued and no live worker" in w for w in status["warnings"]), status["warnings"]
    human = run_cli(settings, "status", COLUMNS="200")
    assert "no live worker" in human.stdout


def test_version_is_the_packages():
    import tomllib

    from redroll import __version__
    from tests.conftest import ROOT

    proc = subprocess.run([sys.executable, "-m", "redroll.cli", "--version"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"redroll {__version__}"
    assert __version__ == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_bare_redroll_prints_the_commands():
    """It printed only an argparse error ("the following arguments are required: COMMAND")."""
    proc = subprocess.run([sys.executable, "-m", "redroll.cli"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "worker" in proc.stdout and "serve" in proc.stdout and not proc.stderr


def test_each_action_has_its_own_flags_and_every_duration_names_its_unit():
    """weights, lanes and functions took their action as a positional choice, so each action's help
    showed every other action's flags; --drain-timeout (seconds) sat beside --claim-idle-ms (ms)."""
    parsers = dict(_parsers(build_parser()))
    assert "--model-path" in parsers["redroll weights update"].format_help()
    assert "--model-path" not in parsers["redroll weights release"].format_help()
    assert "--force" in parsers["redroll lanes set"].format_help()
    assert "--force" not in parsers["redroll lanes show"].format_help()
    assert "--timeout" in parsers["redroll functions wait"].format_help()
    for name, parser in parsers.items():
        for action in parser._actions:
            flag = action.option_strings[0] if action.option_strings else ""
            if flag.endswith("-ms"):
                assert action.metavar == "MS", (name, flag)
            elif flag.endswith(("-timeout", "-interval", "-s")) or flag in ("--interval", "--timeout"):
                assert action.metavar == "SECONDS", (name, flag, action.metavar)


def test_serve_on_a_port_in_use_says_so_in_one_line_and_exits(settings):
    """It printed uvicorn's bind error and then never exited, even on SIGTERM."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_cli(settings, "serve", "--port", str(port), timeout=60)
    assert proc.returncode == 1
    assert one_line(proc) == f"redroll serve: [Errno 98] cannot listen on 127.0.0.1:{port}: Address already in use"
