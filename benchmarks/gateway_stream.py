"""The gateway's streaming: how soon a streamed call's first tokens come, and what streaming costs.

    python -m benchmarks.gateway_stream [--calls 20] [--max-tokens 64] [--token-ms 10] [--concurrency 32] [--runs 3]

On one private redis-server: one synthetic worker process making a token every ``--token-ms``
(so a call of ``--max-tokens`` takes their product to generate), one ``redroll serve`` process,
the worker's chunk settings at their defaults (8 tokens or 50 ms). Each run measures, over
``--calls`` sequential calls of ``POST /v1/completions`` (httpx, keep-alive):

- ``whole_p50_ms``: a call without ``stream``, to its response;
- ``first_chunk_p50_ms`` and ``stream_p50_ms``: a streamed call, to its first event with text and
  to ``[DONE]``; ``keyed_first_chunk_p50_ms``: the same with an ``Idempotency-Key``;
- ``whole_calls_per_s`` and ``stream_calls_per_s``: ``--concurrency`` callers at once, ``--calls``
  each, without and with ``stream``; ``api_whole_calls_per_s`` and ``api_stream_calls_per_s``: the
  same through the Python API (``Producer.generate``, ``Producer.stream``), without the gateway.

The worker reads ``REDROLL_STREAM_CHUNK_TOKENS`` and ``REDROLL_STREAM_CHUNK_MS`` from the
environment: set them high to see what making the chunks costs.

Prints one JSON document: every run, then the median and range of each figure over the runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid

from benchmarks.gateway import ROOT, p50_ms, serve_env, wait_healthy
from benchmarks.harness import median_range


async def _streamed(http, url: str, body: dict, headers: dict | None = None) -> tuple[float, float]:
    """(seconds to the first event with text, seconds to [DONE]) of one streamed call."""
    started = time.perf_counter()
    first = None
    async with http.stream("POST", url, json={**body, "stream": True}, headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            if first is None and json.loads(line[len("data: "):])["choices"][0].get("text"):
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("a streamed call sent no text")
    return first, time.perf_counter() - started


async def one_run(url: str, args: argparse.Namespace) -> dict[str, float]:
    import httpx

    from redroll.producer.client import Producer
    from redroll.shared.settings import Settings
    from tests.gateway_support import free_port

    ns = "bench-gws-" + uuid.uuid4().hex[:6]
    port = free_port()
    env = serve_env(url, ns)
    worker = subprocess.Popen([sys.executable, "-m", "redroll.cli", "worker", "--engine", "synthetic", "--token-ms",
                               str(args.token_ms), "--max-inflight", "256"], env=env, cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    serve = subprocess.Popen([sys.executable, "-m", "redroll.cli", "serve", "--port", str(port), "--max-backlog",
                              "4096"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    endpoint = base + "/v1/completions"
    body = {"model": "redroll", "prompt": "bench", "max_tokens": args.max_tokens}
    try:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=args.concurrency + 8)) as http:
            await wait_healthy(http, base)
            for _ in range(5):  # warm-up: the worker, the connections, the scripts
                (await http.post(endpoint, json=body)).raise_for_status()
                await _streamed(http, endpoint, body)
            whole, first, streamed, keyed_first = [], [], [], []
            for i in range(args.calls):
                t = time.perf_counter()
                (await http.post(endpoint, json=body)).raise_for_status()
                whole.append(time.perf_counter() - t)
                f, s = await _streamed(http, endpoint, body)
                first.append(f)
                streamed.append(s)
                keyed_first.append((await _streamed(http, endpoint, body, {"Idempotency-Key": f"{ns}-{i}"}))[0])

            async def plain_calls() -> None:
                for _ in range(args.calls):
                    (await http.post(endpoint, json=body)).raise_for_status()

            async def streamed_calls() -> None:
                for _ in range(args.calls):
                    await _streamed(http, endpoint, body)

            rates = {}
            for name, fn in (("whole", plain_calls), ("stream", streamed_calls)):
                t = time.perf_counter()
                await asyncio.gather(*(fn() for _ in range(args.concurrency)))
                rates[name] = args.calls * args.concurrency / (time.perf_counter() - t)
        async with Producer(Settings(redis_url=url, namespace=ns)) as producer:
            sp = {"max_new_tokens": args.max_tokens}

            async def api_whole() -> None:
                for _ in range(args.calls):
                    await producer.generate(prompt="bench", sampling_params=sp)

            async def api_stream() -> None:
                for _ in range(args.calls):
                    async for _chunk in producer.stream(prompt="bench", sampling_params=sp):
                        pass

            for name, fn in (("api_whole", api_whole), ("api_stream", api_stream)):
                t = time.perf_counter()
                await asyncio.gather(*(fn() for _ in range(args.concurrency)))
                rates[name] = args.calls * args.concurrency / (time.perf_counter() - t)
        return {"whole_p50_ms": p50_ms(whole), "first_chunk_p50_ms": p50_ms(first),
                "stream_p50_ms": p50_ms(streamed), "keyed_first_chunk_p50_ms": p50_ms(keyed_first),
                "whole_calls_per_s": rates["whole"], "stream_calls_per_s": rates["stream"],
                "api_whole_calls_per_s": rates["api_whole"], "api_stream_calls_per_s": rates["api_stream"]}
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
    chunks = {k: os.environ[k] for k in ("REDROLL_STREAM_CHUNK_TOKENS", "REDROLL_STREAM_CHUNK_MS") if k in os.environ}
    return {"calls": args.calls, "max_tokens": args.max_tokens, "token_ms": args.token_ms,
            "concurrency": args.concurrency, "chunk_settings": chunks, "runs": runs, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--token-ms", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    print(json.dumps(asyncio.run(main_async(parser.parse_args())), indent=2))


if __name__ == "__main__":
    main()
