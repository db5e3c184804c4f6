"""The gateway's cost: its added latency over the Python API, and its throughput.

    python -m benchmarks.gateway [--calls 300] [--throughput-calls 2000] [--concurrency 16] [--runs 3]

On one private redis-server: one synthetic worker process (instant engine: no token time, so
what is measured is the queue and the gateway), one ``redroll serve`` process. Each run measures

- latency: ``--calls`` sequential calls of 16 tokens, through ``Producer.generate`` (the Python
  API, in this process) and through ``POST /v1/completions`` (httpx, keep-alive), without and with
  an ``Idempotency-Key``; p50 of each, and the gateway's added p50 over the Python API;
- throughput: ``--throughput-calls`` calls, ``--concurrency`` at a time, through the gateway, and
  the same through the Python API (calls/s).

Prints one JSON document: every run, then the median and range of each figure over the runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from benchmarks.harness import median_range

ROOT = Path(__file__).resolve().parent.parent


def serve_env(url: str, ns: str) -> dict[str, str]:
    return {**os.environ, "REDROLL_REDIS_URL": url, "REDROLL_NAMESPACE": ns, "PYTHONPATH": str(ROOT)}


async def wait_healthy(client, url: str) -> None:
    for _ in range(600):
        try:
            if (await client.get(url + "/health")).status_code == 200:
                return
        except Exception:
            pass
        await asyncio.sleep(0.1)
    raise TimeoutError("redroll serve did not start")


def p50_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000.0


async def one_run(url: str, args: argparse.Namespace) -> dict[str, float]:
    import httpx

    from redroll.producer.client import Producer
    from redroll.shared.settings import Settings

    ns = "bench-gw-" + uuid.uuid4().hex[:6]
    from tests.gateway_support import free_port

    port = free_port()
    env = serve_env(url, ns)
    worker = subprocess.Popen([sys.executable, "-m", "redroll.cli", "worker", "--engine", "synthetic", "--token-ms", "0",
                               "--max-inflight", "256"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    serve = subprocess.Popen([sys.executable, "-m", "redroll.cli", "serve", "--port", str(port), "--max-backlog",
                              "100000"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(os.environ.get("GATEWAY_BENCH_LOG", os.devnull), "ab"))
    base = f"http://127.0.0.1:{port}"
    body = {"model": "redroll", "prompt": "bench", "max_tokens": 16}
    try:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=args.concurrency + 8)) as http, \
                Producer(Settings(redis_url=url, namespace=ns), block_ms=1000) as producer:
            await wait_healthy(http, base)
            sp = {"max_new_tokens": 16}
            for _ in range(50):  # warm-up: the worker, both connections, the scripts
                await producer.generate(prompt="bench", sampling_params=sp)
                (await http.post(base + "/v1/completions", json=body)).raise_for_status()
            api, gw, keyed = [], [], []
            for i in range(args.calls):
                t = time.perf_counter()
                await producer.generate(prompt="bench", sampling_params=sp)
                api.append(time.perf_counter() - t)
                t = time.perf_counter()
                (await http.post(base + "/v1/completions", json=body)).raise_for_status()
                gw.append(time.perf_counter() - t)
                t = time.perf_counter()
                (await http.post(base + "/v1/completions", json=body,
                                 headers={"Idempotency-Key": f"{ns}-{i}"})).raise_for_status()
                keyed.append(time.perf_counter() - t)

            async def through_gateway(n: int) -> None:
                for _ in range(n):
                    (await http.post(base + "/v1/completions", json=body)).raise_for_status()

            async def through_api(n: int) -> None:
                for _ in range(n):
                    await producer.generate(prompt="bench", sampling_params=sp)

            per = args.throughput_calls // args.concurrency
            rates = {}
            for name, fn in (("gateway", through_gateway), ("api", through_api)):
                t = time.perf_counter()
                await asyncio.gather(*(fn(per) for _ in range(args.concurrency)))
                rates[name] = per * args.concurrency / (time.perf_counter() - t)
        return {"api_p50_ms": p50_ms(api), "gateway_p50_ms": p50_ms(gw), "keyed_p50_ms": p50_ms(keyed),
                "added_p50_ms": p50_ms(gw) - p50_ms(api), "keyed_added_p50_ms": p50_ms(keyed) - p50_ms(api),
                "gateway_calls_per_s": rates["gateway"], "api_calls_per_s": rates["api"]}
    finally:
        for proc in (serve, worker):
            proc.terminate()
        for proc in (serve, worker):
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


async def main_async(args: argparse.Namespace) -> dict:
    from redroll.testing.embedded import start_redis_server

    server = start_redis_server()
    try:
        runs = [await one_run(server.url, args) for _ in range(args.runs)]
    finally:
        server.stop()
    summary = median_range(runs)
    return {"calls": args.calls, "throughput_calls": args.throughput_calls, "concurrency": args.concurrency,
            "runs": runs, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--throughput-calls", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    print(json.dumps(asyncio.run(main_async(parser.parse_args())), indent=2))


if __name__ == "__main__":
    main()
