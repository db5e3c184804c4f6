"""The gateway with a vLLM worker against ``vllm serve``: the same calls, the same engine.

    python -m benchmarks.gateway_vllm [--calls 128] [--max-tokens 64] [--concurrency 32] [--rounds 4]
                                      [--runs 3] [--model-path DIR] [--kv-cache-gib 0.5] [--max-num-seqs 32]

Run in the virtualenv that has vLLM (``.venv-vllm``, made by ``.ci/vllm-env``). Starts, once:

- redroll: a private redis-server, one ``redroll worker --engine vllm`` and one ``redroll serve``;
- vLLM alone: its own OpenAI server (``python -m vllm.entrypoints.openai.api_server``, what
  ``vllm serve`` runs), on the same checkpoint (default: the tiny test checkpoint) with the same
  engine arguments: dtype float32, ``max_num_seqs``, the KV cache size, ``enforce_eager``, chunked
  prefill off (the worker's CPU defaults), prefix caching on, the same context length.

While one stack is measured the other is stopped (SIGSTOP; ``--no-pause-idle`` leaves it running):
vLLM's engine processes spin while idle, and on two cores the idle stack's spinning took CPU from
the measured one, in either direction. Then, after a warm-up of each, each run is ``--rounds`` rounds; a round sends ``--calls``
completions of ``--max-tokens`` tokens (``ignore_eos``, seeded sampling), ``--concurrency`` at a
time, through the ``openai`` async client, to one server and then the other, in ABBA order
(redroll first, then vLLM first, ...), so that a change in the machine's load falls on both. It
reports the completion tokens per second of each over the run's rounds and their ratio (redroll /
vLLM; 1.0 is parity), per run and as the median and range over the runs, as one JSON document,
with the CPU time each process (a server's children: its engine core) spent per call, and the
median wall time of ``--latency-calls`` calls sent one at a time to each (no batch hides a delay).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.harness import median_range

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, env=env, cwd=ROOT, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _wait_ready(client, procs: list[subprocess.Popen], logs: list[Path], timeout_s: float = 600) -> None:
    """Until a 1-token completion answers (the engine is up behind the server)."""
    deadline = time.monotonic() + timeout_s
    while True:
        for proc, log in zip(procs, logs):
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            await client.completions.create(model=MODEL, prompt="warm", max_tokens=1)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1.0)


async def one_pass(client, args: argparse.Namespace, calls: int) -> dict[str, float]:
    """``calls`` completions, ``--concurrency`` at a time: wall time and completion tokens/s."""
    queue = list(range(calls))
    tokens = 0

    async def lane() -> None:
        nonlocal tokens
        while queue:
            i = queue.pop()
            out = await client.completions.create(
                model=MODEL, prompt=f"request {i}: the quick brown fox jumps over the lazy dog",
                max_tokens=args.max_tokens, temperature=1.0, seed=i, extra_body={"ignore_eos": True})
            tokens += out.usage.completion_tokens

    t = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(args.concurrency)))
    wall = time.perf_counter() - t
    if tokens != calls * args.max_tokens:
        raise RuntimeError(f"expected {calls * args.max_tokens} completion tokens, got {tokens}")
    return {"wall_s": wall, "tokens_per_s": tokens / wall}


async def sequential_p50_ms(client, args: argparse.Namespace, calls: int) -> float:
    """The median wall time of ``calls`` calls sent one at a time (no batching to hide a delay)."""
    times = []
    for i in range(calls):
        t = time.perf_counter()
        await client.completions.create(model=MODEL, prompt=f"alone {i}: the quick brown fox", seed=i,
                                        max_tokens=args.max_tokens, temperature=1.0, extra_body={"ignore_eos": True})
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000.0


def _cpu_s(pid: int, *, children: bool) -> float:
    """CPU seconds (user + system) so far of a process, or of its descendants (the engine core)."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) if children else [root]
    except psutil.NoSuchProcess:
        return 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def _engine_flags(args: argparse.Namespace) -> dict[str, list[str]]:
    """The same engine, spelled for each server."""
    kv = int(args.kv_cache_gib * (1 << 30))
    return {
        "redroll": ["--dtype", "float32", "--context-length", str(args.max_model_len),
                    "--max-running-requests", str(args.max_num_seqs), "--kv-cache-gib", str(args.kv_cache_gib),
                    "--vllm-arg", "enforce_eager=true", "--vllm-arg", "enable_chunked_prefill=false"],
        "vllm": ["--dtype", "float32", "--max-model-len", str(args.max_model_len),
                 "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory-bytes", str(kv),
                 "--enforce-eager", "--no-enable-chunked-prefill", "--enable-prefix-caching",
                 "--disable-log-stats"],  # (the worker's engine runs with disable_log_stats too)
    }


@contextlib.asynccontextmanager
async def _paused(stacks: dict[str, list[subprocess.Popen]], measured: str, pause: bool, clients: dict):
    """While ``measured`` runs, the other stack's processes (each started in a session of its own:
    its process group holds its engine processes too) are stopped with SIGSTOP: vLLM's engine
    processes spin while idle (``sched_yield``), and on two cores an idle stack's spinning took
    CPU from the measured one. Redis stays up (it does not spin). A stack let go again is measured
    only once it answers a call (the gateway's health check counts a stop as Redis unreachable
    for a second)."""
    others = [name for name in stacks if name != measured] if pause else []
    for name in others:
        for proc in stacks[name]:
            os.killpg(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for name in others:
            for proc in stacks[name]:
                os.killpg(proc.pid, signal.SIGCONT)
        for name in others:
            await _wait_ready(clients[name], stacks[name], [Path(os.devnull)] * len(stacks[name]), 120)


async def main_async(args: argparse.Namespace) -> dict:
    import openai

    from redroll.testing.embedded import start_redis_server

    work = Path(tempfile.mkdtemp(prefix="gw-vllm-bench-"))
    model = args.model_path
    if model is None:
        from redroll.engine_worker.engines.tiny_checkpoint import save_tiny_checkpoint

        model = str(save_tiny_checkpoint(work / "tiny", 0))
    flags = _engine_flags(args)
    server = start_redis_server()
    env = {**os.environ, "REDROLL_REDIS_URL": server.url, "REDROLL_NAMESPACE": "bench-gv-" + uuid.uuid4().hex[:6],
           "PYTHONPATH": str(ROOT), "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    gw_port, vllm_port = _free_port(), _free_port()
    logs = {name: work / f"{name}.log" for name in ("worker", "serve", "vllm")}
    procs: dict[str, subprocess.Popen] = {}
    clients: dict[str, openai.AsyncOpenAI] = {}
    try:
        procs["worker"] = _start([sys.executable, "-m", "redroll.cli", "worker", "--engine", "vllm", "--model-path",
                                  model, *flags["redroll"], "--max-inflight", str(args.max_inflight),
                                  *(["--claim-prefetch", str(args.claim_prefetch)] if args.claim_prefetch is not None
                                    else [])],
                                 env, logs["worker"])
        procs["serve"] = _start([sys.executable, "-m", "redroll.cli", "serve", "--port", str(gw_port),
                                 "--model-name", MODEL, "--max-backlog", "10000", "--request-timeout", "600"],
                                env, logs["serve"])
        procs["vllm"] = _start([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                                "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(vllm_port),
                                "--disable-uvicorn-access-log", *flags["vllm"]], env, logs["vllm"])
        limits = {"timeout": 600, "max_retries": 0, "api_key": "unused"}
        clients["redroll"] = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gw_port}/v1", **limits)
        clients["vllm"] = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{vllm_port}/v1", **limits)
        await _wait_ready(clients["redroll"], [procs["worker"], procs["serve"]], [logs["worker"], logs["serve"]])
        await _wait_ready(clients["vllm"], [procs["vllm"]], [logs["vllm"]])
        pids = {"redroll_worker": (procs["worker"].pid, False), "redroll_engine_core": (procs["worker"].pid, True),
                "redroll_serve": (procs["serve"].pid, False), "redroll_redis": (server.process.pid, False),
                "vllm_server": (procs["vllm"].pid, False), "vllm_engine_core": (procs["vllm"].pid, True)}
        stacks = {"redroll": [procs["worker"], procs["serve"]], "vllm": [procs["vllm"]]}
        for name in ("redroll", "vllm"):  # warm-up: connections, the scheduler, the server's paths
            async with _paused(stacks, name, args.pause_idle, clients):
                await one_pass(clients[name], args, args.concurrency)
        runs = []
        for run in range(args.runs):
            spent = {"redroll": 0.0, "vllm": 0.0}
            cpu = {role: 0.0 for role in pids}
            for r in range(args.rounds):  # ABBA: a drift in the machine's load falls on both alike
                order = ("redroll", "vllm") if (run * args.rounds + r) % 4 in (0, 3) else ("vllm", "redroll")
                for name in order:
                    async with _paused(stacks, name, args.pause_idle, clients):
                        before = {role: _cpu_s(pid, children=c) for role, (pid, c) in pids.items()}
                        spent[name] += (await one_pass(clients[name], args, args.calls))["wall_s"]
                        for role, (pid, c) in pids.items():
                            if role.startswith(name):
                                cpu[role] += _cpu_s(pid, children=c) - before[role]
            tokens = args.rounds * args.calls * args.max_tokens
            alone = {}
            for name in (("redroll", "vllm") if run % 2 == 0 else ("vllm", "redroll")):
                async with _paused(stacks, name, args.pause_idle, clients):
                    alone[name] = await sequential_p50_ms(clients[name], args, args.latency_calls)
            runs.append({"redroll_tokens_per_s": tokens / spent["redroll"], "vllm_tokens_per_s": tokens / spent["vllm"],
                         "ratio": spent["vllm"] / spent["redroll"],
                         "redroll_alone_p50_ms": alone["redroll"], "vllm_alone_p50_ms": alone["vllm"],
                         "cpu_ms_per_call": {role: 1000.0 * v / (args.rounds * args.calls) for role, v in cpu.items()}})
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    finally:
        for client in clients.values():
            await client.close()
        for proc in procs.values():
            _stop(proc)
        server.stop()
    keys = ("redroll_tokens_per_s", "vllm_tokens_per_s", "ratio", "redroll_alone_p50_ms", "vllm_alone_p50_ms")
    summary = median_range(runs, keys)
    return {"model": "tiny checkpoint" if args.model_path is None else args.model_path, "calls": args.calls,
            "max_tokens": args.max_tokens, "rounds": args.rounds, "concurrency": args.concurrency, "max_num_seqs": args.max_num_seqs,
            "kv_cache_gib": args.kv_cache_gib, "pause_idle": args.pause_idle, "logs": str(work), "runs": runs,
            "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4, help="rounds per run (each: --calls to each server)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--latency-calls", type=int, default=20,
                        help="calls sent one at a time to each server per run (their median wall time)")
    parser.add_argument("--model-path", default=None, help="a model directory (default: the tiny test checkpoint)")
    parser.add_argument("--kv-cache-gib", type=float, default=0.5)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-inflight", type=int, default=64, help="the redroll worker's --max-inflight")
    parser.add_argument("--no-pause-idle", dest="pause_idle", action="store_false",
                        help="leave the stack not measured running (by default it is stopped with SIGSTOP during "
                             "the other's passes: its idle engine spins)")
    parser.add_argument("--claim-prefetch", type=int, default=None,
                        help="the redroll worker's --claim-prefetch (default: the worker's)")
    print(json.dumps(asyncio.run(main_async(parser.parse_args())), indent=2))


if __name__ == "__main__":
    main()
