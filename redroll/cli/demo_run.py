"""``redroll demo``: the whole pipeline in one process on the embedded default.

A worker with the tiny CPU model (or the synthetic engine when torch is not installed), a
consumer group applying a printing callback, and a few prompts submitted through the queue.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from typing import Any

from redroll.cli.runtime import run as run_async_main
from redroll.consumer.runner import ConsumerRunner
from redroll.engine_worker.engines import create_engine
from redroll.engine_worker.engines.declaration import capabilities_of
from redroll.engine_worker.worker import Worker
from redroll.producer.client import Producer, make_request, send
from redroll.shared.connection import connect
from redroll.shared.settings import Settings
from redroll.shared.types import CompletionRecord
from redroll.testing.embedded import embedded_redis

DEMO_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a queue far away,",
    "Redis Streams keep every request until",
    "An RL trainer asks for eight samples of",
    "The worker that died left its lease to",
]


def _has_torch() -> bool:
    try:
        return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
    except (ImportError, ValueError, AttributeError):
        return False


def _decode(engine: Any, ids: list[int]) -> str:
    tok = engine.tokenizer if capabilities_of(engine).tokenizer else None
    if tok is not None:
        try:
            return tok.decode(ids, skip_special_tokens=True)
        except Exception:
            pass
    return " ".join(map(str, ids[:16]))


async def run_demo(settings: Settings, *, prompts: int = 4, engine_name: str | None = None,
                   max_new_tokens: int = 24, timeout: float = 300.0) -> int:
    has_torch = _has_torch()
    engine_name = engine_name or ("transformers" if has_torch else "synthetic")
    if engine_name == "transformers":
        engine = create_engine("transformers", model_path="tiny-random")
        note = "transformers engine, tiny random model (byte tokenizer; the text is noise by design)"
    else:
        engine = create_engine("synthetic", token_ms=2.0, vocab_size=256)
        # Suggest the install only where it is missing, not to one who asked for synthetic.
        note = "synthetic engine (token ids without a model; the text is their numbers)"
        if not has_torch:
            note += "; install redroll[cpu] for the tiny transformers model"
    print(f"engine: {note}")
    worker = Worker(settings, engine, max_inflight=8)
    chosen = (DEMO_PROMPTS * (prompts // len(DEMO_PROMPTS) + 1))[:prompts]
    done = asyncio.Event()
    shown: list[str] = []

    def show(record: CompletionRecord) -> None:
        prompt = record.meta_info.get("prompt", "")
        text = _decode(engine, record.output_token_ids[0]) if record.output_token_ids else ""
        lp = record.output_logprobs[0] if record.output_logprobs else []
        mean_lp = sum(lp) / len(lp) if lp else float("nan")
        print(f"[{record.request_id}] {record.status.value} ({record.finish_reasons[0]}, "
              f"{record.meta_info.get('completion_tokens')} tokens, mean logprob {mean_lp:.2f}, "
              f"{record.meta_info.get('engine_ms')} ms)\n    {prompt!r} -> {text!r}")
        shown.append(record.request_id)
        if len(shown) >= len(chosen):
            done.set()

    consumer = ConsumerRunner(settings, group="demo", handlers={"print": show}, trim_interval_s=1.0)
    tasks = [asyncio.create_task(worker.run()), asyncio.create_task(consumer.run())]
    r = connect(settings)
    try:
        requests = [make_request(request_id=f"demo-{i}", prompt=p, callback="print", return_logprob=True,
                                 meta_info={"prompt": p},
                                 sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0.8,
                                                  "sampling_seed": i})
                    for i, p in enumerate(chosen)]
        await send(settings, r, requests)
        print(f"submitted {len(requests)} prompts to {settings.keys.requests}; waiting for callbacks...")
        await asyncio.wait_for(done.wait(), timeout)
        # The same path, awaited in-process through a producer's private reply stream.
        async with Producer(settings) as producer:
            record = await asyncio.wait_for(await producer.submit(
                prompt="Awaited directly:", sampling_params={"max_new_tokens": 8, "sampling_seed": 7}), timeout)
            print(f"awaited record: {record.status.value}, {len(record.output_token_ids[0])} tokens "
                  f"-> {_decode(engine, record.output_token_ids[0])!r}")
        return 0
    finally:
        worker.request_stop()
        consumer.request_stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        await r.aclose()


def main_demo(namespace: str, prompts: int, engine_name: str | None, redis_url: str | None) -> int:
    env_url = redis_url
    if env_url:
        settings = Settings.from_env(redis_url=env_url, namespace=namespace)
        return run_async_main(run_demo(settings, prompts=prompts, engine_name=engine_name))
    with embedded_redis() as (url, how):
        print(f"redis: {how}")
        settings = Settings.from_env(redis_url=url, namespace=namespace)
        return run_async_main(run_demo(settings, prompts=prompts, engine_name=engine_name))


if __name__ == "__main__":
    sys.exit(main_demo("redroll-demo", 4, None, None))
