"""A worker SIGKILLed in the middle of a streamed greedy chat completion served by ``redroll serve``:
the client's stream (the official ``openai`` SDK, and ``curl -N`` for the raw events) goes on from
another worker, and the text it receives equals an uninterrupted run's, no token twice, none missing.

The doomed worker is a real ``redroll worker`` process (transformers, the tiny checkpoint with a
chat template); the survivor starts only after the kill, so every token after the kill is its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("transformers")

from redroll.engine_worker.worker import Worker  # noqa: E402
from tests.conftest import running, spawn  # noqa: E402
from tests.gateway_support import Served  # noqa: E402
from tests.support.processes import stop_process  # noqa: E402

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Grüße aus 東京 😀, a queue of requests"}]
TOKENS = 600
CHUNKS = {"REDROLL_STREAM_CHUNK_TOKENS": "4", "REDROLL_STREAM_CHUNK_MS": "20"}


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    from redroll.engine_worker.engines.tiny_checkpoint import TINY_CHAT_TEMPLATE, save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-chat"), seed=0, chat_template=TINY_CHAT_TEMPLATE)


def doomed_worker(settings, checkpoint, log):
    return spawn(settings, "worker", "--engine", "transformers", "--model-path", str(checkpoint), "--max-inflight",
                 "4", "--name", "doomed", log=log, **CHUNKS)


def survivor(settings, checkpoint) -> Worker:
    from redroll.engine_worker.engines.transformers_engine import TransformersEngine

    return Worker(settings.with_(stream_chunk_tokens=4, stream_chunk_ms=20), TransformersEngine(str(checkpoint)),
                  max_inflight=4, block_ms=100, name="survivor")


GREEDY = dict(max_tokens=TOKENS, temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True})


async def test_the_sdks_stream_goes_on_from_another_worker(settings, tmp_path, chat_checkpoint):
    gateway = Served(settings, log=tmp_path / "serve.log")
    proc = doomed_worker(settings, chat_checkpoint, tmp_path / "doomed.log")
    client = openai.AsyncOpenAI(base_url=gateway.v1, api_key="unused", max_retries=0, timeout=300)
    text, ids, finish, contents = "", [], None, 0
    try:
        stream = await client.chat.completions.create(model="redroll", messages=CHAT, stream=True, **GREEDY)
        async with running_later() as later:
            async for chunk in stream:
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    ids += (choice.model_extra or {}).get("token_ids") or []
                    finish = choice.finish_reason or finish
                    contents += bool(choice.delta.content)
                if contents == 3 and proc.poll() is None:  # mid-stream: kill its worker, then start another
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()
                    killed_at = len(ids)
                    rescuer = survivor(settings, chat_checkpoint)
                    await later.start(rescuer)
            clean = await client.chat.completions.create(model="redroll", messages=CHAT, **GREEDY)
    finally:
        await client.close()
        if proc.poll() is None:
            stop_process(proc)
        gateway.stop()
    expected = clean.choices[0]
    assert finish == "length" and 0 < killed_at < TOKENS
    assert ids == expected.model_extra["token_ids"] and len(ids) == TOKENS  # no token twice, none missing
    assert text == expected.message.content
    # the survivor continued after what was sent, it did not start over: it decoded the rest of the
    # streamed chat and the whole uninterrupted one, not two whole chats
    assert rescuer.engine.tokens_decoded < 2 * TOKENS


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
async def test_curls_raw_events_go_on_from_another_worker(settings, tmp_path, chat_checkpoint):
    gateway = Served(settings, log=tmp_path / "serve.log")
    proc = doomed_worker(settings, chat_checkpoint, tmp_path / "doomed.log")
    body = {"model": "redroll", "messages": CHAT, "stream": True, "max_tokens": TOKENS, "temperature": 0.0,
            "ignore_eos": True}
    curl = await asyncio.create_subprocess_exec(
        "curl", "-sN", gateway.v1 + "/chat/completions", "-H", "Content-Type: application/json",
        "-d", json.dumps(body), stdout=asyncio.subprocess.PIPE)
    events: list[str] = []
    try:
        async with running_later() as later:
            while line := await asyncio.wait_for(curl.stdout.readline(), 300):
                if line.startswith(b"data: "):
                    events.append(line[6:].decode().strip())
                contents = sum(1 for e in events if e != "[DONE]" and json.loads(e)["choices"]
                               and json.loads(e)["choices"][0]["delta"].get("content"))
                if contents == 3 and proc.poll() is None:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()
                    await later.start(survivor(settings, chat_checkpoint))
            await curl.wait()
            client = openai.AsyncOpenAI(base_url=gateway.v1, api_key="unused", max_retries=0, timeout=300)
            try:
                clean = await client.chat.completions.create(model="redroll", messages=CHAT, **GREEDY)
            finally:
                await client.close()
    finally:
        if proc.poll() is None:
            stop_process(proc)
        gateway.stop()
    assert events[-1] == "[DONE]" and proc.returncode == -signal.SIGKILL
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == clean.choices[0].message.content and chunks[-1]["choices"][0]["finish_reason"] == "length"


class running_later:
    """Workers started inside the block (after a kill), all stopped when it ends."""

    def __init__(self):
        self.started = []

    async def start(self, worker: Worker) -> None:
        cm = running(worker)
        await cm.__aenter__()
        self.started.append(cm)

    async def __aenter__(self) -> "running_later":
        return self

    async def __aexit__(self, *exc) -> None:
        for cm in reversed(self.started):
            await cm.__aexit__(None, None, None)
