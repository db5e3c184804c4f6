"""``redroll serve`` streaming (``stream: true``, server-sent events), driven as clients drive it:
the official ``openai`` SDK (async and sync) and ``curl -N``, against synthetic workers that make
a token every few milliseconds, so that chunks really come while the request runs."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from redroll.engine_worker.worker import Worker  # noqa: E402
from tests.conftest import running, wait_until  # noqa: E402
from tests.gateway_support import CountingEngine, Served  # noqa: E402

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a stream of tokens"}]


@pytest.fixture
def gateway_log(tmp_path):
    return tmp_path / "serve.log"


@pytest.fixture
async def sdk():
    """``sdk(gateway)``: an async openai client of that gateway (no SDK retries: the tests retry)."""
    made = []

    def client(gateway: Served) -> "openai.AsyncOpenAI":
        made.append(openai.AsyncOpenAI(base_url=gateway.v1, api_key="unused", max_retries=0, timeout=60))
        return made[-1]
    yield client
    for c in made:
        await c.close()


async def waiting(http: "httpx.AsyncClient", gateway: Served) -> bool:
    """True once ``gateway`` has no call waiting."""
    return (await http.get(gateway.url + "/health")).json()["waiting"] == 0


def worker(settings, engine) -> Worker:
    return Worker(settings, engine, max_inflight=16, block_ms=100)


async def collect(stream) -> list:
    return [chunk async for chunk in stream]


def texts(chunks: list, chat: bool) -> dict[int, str]:
    """Each choice's concatenated deltas."""
    out: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            piece = (choice.delta.content or "") if chat else choice.text
            out[choice.index] = out.get(choice.index, "") + piece
    return out


def finishes(chunks: list) -> dict[int, list]:
    """Each choice's finish_reason values, in order."""
    out: dict[int, list] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            out.setdefault(choice.index, []).append(choice.finish_reason)
    return out


async def test_streaming_through_the_sdk(settings, gateway_log, sdk):
    """Chat and completions streamed with the async and the sync client: the deltas add up to the
    non-streamed text; n = 4 and several prompts fan out (choice i seeded seed + i); usage; logprobs;
    token ids."""
    engine = CountingEngine(token_ms=4)
    gateway = Served(settings, log=gateway_log)
    try:
        async with running(worker(settings, engine)):
            client = sdk(gateway)
            # chat: the role first, then content deltas, finish_reason on the last chunk only
            plain = await client.chat.completions.create(model="redroll", messages=CHAT, max_tokens=12, seed=3,
                                                         logprobs=True, extra_body={"return_token_ids": True})
            chunks = await collect(await client.chat.completions.create(
                model="redroll", messages=CHAT, max_tokens=12, seed=3, stream=True, logprobs=True,
                extra_body={"return_token_ids": True}))
            assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
            assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
            assert texts(chunks, chat=True) == {0: plain.choices[0].message.content}
            assert finishes(chunks)[0][-1] == "length" and set(finishes(chunks)[0][:-1]) == {None}
            streamed_lps = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
            assert [(e.token, e.logprob) for e in streamed_lps] == [
                (e.token, e.logprob) for e in plain.choices[0].logprobs.content]
            ids = [t for c in chunks[1:] for ch in c.choices for t in ch.model_extra["token_ids"]]
            assert ids == plain.choices[0].model_extra["token_ids"] and len(ids) == 12

            # completions, n = 4, usage: every index, each equal to a non-streamed call seeded 7 + i
            chunks = await collect(await client.completions.create(
                model="redroll", prompt="the queue", max_tokens=10, n=4, seed=7, stream=True, logprobs=0,
                stream_options={"include_usage": True}, extra_body={"return_token_ids": True}))
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
            assert chunks[-1].usage.prompt_tokens == len("the queue")  # (the prompt counted once)
            assert all(c.usage is None for c in chunks[:-1])
            streamed = texts(chunks, chat=False)
            assert set(streamed) == {0, 1, 2, 3}
            singles = await asyncio.gather(*(client.completions.create(
                model="redroll", prompt="the queue", max_tokens=10, seed=7 + i, logprobs=0) for i in range(4)))
            assert streamed == {i: one.choices[0].text for i, one in enumerate(singles)}
            for i, one in enumerate(singles):
                mine = [ch for c in chunks for ch in c.choices if ch.index == i]
                assert [lp for ch in mine for lp in ch.logprobs.token_logprobs] == one.choices[0].logprobs.token_logprobs
                assert [f for ch in mine for f in [ch.finish_reason]][-1] == "length"
            assert len(set(streamed.values())) == 4  # (four samples, not one four times)

            # a token-id prompt and several prompts: prompt_token_ids on each choice's first chunk
            chunks = await collect(await client.completions.create(
                model="redroll", prompt=[[5, 6, 7], [8, 9]], max_tokens=6, n=2, seed=1, stream=True,
                extra_body={"return_token_ids": True}))
            firsts = {}
            for c in chunks:
                for ch in c.choices:
                    firsts.setdefault(ch.index, ch.model_extra)
            assert {i: e["prompt_token_ids"] for i, e in firsts.items()} == {
                0: [5, 6, 7], 1: [5, 6, 7], 2: [8, 9], 3: [8, 9]}
            plain = await client.completions.create(model="redroll", prompt=[8, 9], max_tokens=6, seed=1 + 3)
            assert texts(chunks, chat=False)[3] == plain.choices[0].text

            def sync_stream() -> tuple:
                sync = openai.OpenAI(base_url=gateway.v1, api_key="unused", max_retries=0, timeout=60)
                try:
                    whole = sync.chat.completions.create(model="redroll", messages=CHAT, max_tokens=8, seed=5)
                    parts = sync.chat.completions.create(model="redroll", messages=CHAT, max_tokens=8, seed=5,
                                                         stream=True)
                    singles = [sync.completions.create(model="redroll", prompt="sync", max_tokens=8, seed=5 + i)
                               for i in range(2)]
                    pieces = list(sync.completions.create(model="redroll", prompt="sync", max_tokens=8, seed=5, n=2,
                                                          stream=True, stream_options={"include_usage": True}))
                    return whole, list(parts), singles, pieces
                finally:
                    sync.close()
            whole, parts, singles, pieces = await asyncio.to_thread(sync_stream)
            assert texts(parts, chat=True) == {0: whole.choices[0].message.content}
            assert whole.choices[0].message.content.count(" ") == 8  # (eight synthetic words, each after a space)
            assert texts(pieces, chat=False) == {i: one.choices[0].text for i, one in enumerate(singles)}
            assert pieces[-1].usage.completion_tokens == 16 and pieces[-1].choices == []
    finally:
        gateway.stop()


class FailsWhenTold(CountingEngine):
    """Fails a request whose prompt holds "fail-later", once ``told`` is set (after its stream began)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.told = asyncio.Event()

    async def generate(self, request, handle):
        if request.prompt and "fail-later" in request.prompt:
            self._count(request)
            await self.told.wait()
            raise RuntimeError("the engine failed mid-stream")
        return await super().generate(request, handle)


def curl_stream(url: str, payload: dict, on_line=None) -> tuple[list[str], str]:
    """``curl -N`` a streamed call: (its non-blank lines, in order; the Content-Type it answered).
    ``on_line(line)`` sees each line as it comes."""
    proc = subprocess.Popen(["curl", "-N", "-s", "-D", "/dev/stderr", "--max-time", "60", url, "-H",
                             "Content-Type: application/json", "-d", json.dumps(payload)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        if line.strip():
            lines.append(line.rstrip("\n"))
            if on_line is not None:
                on_line(lines[-1])
    head = proc.stderr.read()
    proc.wait(30)
    content_type = next((h.split(":", 1)[1].strip() for h in head.splitlines()
                         if h.lower().startswith("content-type:")), "")
    return lines, content_type


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_raw_events_with_curl(settings, gateway_log, sdk):
    """Raw SSE lines: chunks arrive while the request is still generating, several of them before the
    finish, ``data: [DONE]`` last. Errors before the first byte are JSON with their status; a record
    that fails after the stream began ends it with an error event, then [DONE] (the SDK raises it)."""
    engine = FailsWhenTold(token_ms=25)
    gateway = Served(settings, log=gateway_log)
    loop = asyncio.get_running_loop()
    try:
        async with running(worker(settings, engine)):
            generating_at_first_chunk = []

            def watch(line: str) -> None:
                if not generating_at_first_chunk and '"text":" ' in line:
                    generating_at_first_chunk.append(len(engine._running))

            lines, content_type = await asyncio.to_thread(curl_stream, f"{gateway.v1}/completions", {
                "prompt": "curl", "max_tokens": 60, "stream": True, "seed": 2}, watch)
            assert content_type.startswith("text/event-stream")
            assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
            events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
            assert all(e["object"] == "text_completion" and len(e["choices"]) == 1 for e in events)
            content = [e for e in events if e["choices"][0]["text"] and e["choices"][0]["finish_reason"] is None]
            assert len(content) >= 2 and events[-1]["choices"][0]["finish_reason"] == "length"
            assert generating_at_first_chunk == [1]  # (the first chunk came while its request was generating)
            assert "".join(e["choices"][0]["text"] for e in events).count(" ") == 60

            # errors before the first byte: JSON, with their status
            for payload, param in (({"messages": CHAT, "stream": True, "logprobs": True, "top_logprobs": 2},
                                    "top_logprobs"),  # (refused by the worker: the synthetic engine has none)
                                   ({"messages": CHAT, "stream_options": {"include_usage": True}}, "stream_options")):
                out = (await asyncio.to_thread(  # (a thread: the worker runs in this event loop)
                    subprocess.run, ["curl", "-s", "-w", "\n%{http_code}", "--max-time", "60",
                                     f"{gateway.v1}/chat/completions", "-H", "Content-Type: application/json",
                                     "-d", json.dumps(payload)], capture_output=True, text=True, timeout=90)).stdout
                body, _, status = out.rpartition("\n")
                assert status == "400" and json.loads(body)["error"]["param"] == param, (payload, out)

            # an error after the stream began: the error event, then [DONE]
            def release(line: str) -> None:
                if '"text":" ' in line:
                    loop.call_soon_threadsafe(engine.told.set)

            lines, _ = await asyncio.to_thread(curl_stream, f"{gateway.v1}/completions", {
                "prompt": ["a fine prompt", "fail-later"], "max_tokens": 80, "stream": True}, release)
            assert engine.told.is_set() and lines[-1] == "data: [DONE]"
            error = json.loads(lines[-2][len("data: "):])["error"]
            assert error["type"] == "server_error" and "mid-stream" in error["message"], lines[-2]

            # the same through the SDK: the error event raises
            engine.told = asyncio.Event()
            stream = await sdk(gateway).completions.create(model="redroll", prompt=["a fine prompt", "fail-later"],
                                                           max_tokens=80, stream=True)
            with pytest.raises(openai.APIError, match="mid-stream"):
                async for chunk in stream:
                    if any(ch.text for ch in chunk.choices):
                        engine.told.set()
    finally:
        gateway.stop()


async def test_a_stream_that_outlives_the_request_timeout_ends_with_a_timeout_event(settings, gateway_log):
    """``--request-timeout`` running out after the stream began: the chunks so far, then a 504 error
    event (type ``timeout``) and [DONE]; the request goes on."""
    engine = CountingEngine(token_ms=25)
    gateway = Served(settings, "--request-timeout", "1", log=gateway_log)
    try:
        async with running(worker(settings, engine)):
            lines, _ = await asyncio.to_thread(curl_stream, f"{gateway.v1}/completions", {
                "prompt": "slow", "max_tokens": 400, "stream": True})
            assert lines[-1] == "data: [DONE]"
            events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
            assert any(e.get("choices") and e["choices"][0]["text"] for e in events)  # (it had begun)
            error = events[-1]["error"]
            assert error["type"] == "timeout" and error["code"] == "timeout", error
    finally:
        gateway.stop()


async def test_a_dropped_stream_retried_on_another_gateway(settings, gateway_log, sdk):
    """The client drops a keyed stream after its first chunks and retries it (same Idempotency-Key,
    same body) on a second gateway process: the whole completion from its start, equal to an
    uninterrupted run's, each request generated once; a retry after the record is read from it."""
    engine = CountingEngine(token_ms=20)
    one, two = Served(settings, log=gateway_log), Served(settings, log=gateway_log)
    try:
        async with running(worker(settings, engine)):
            a, b = sdk(one), sdk(two)
            ask = dict(model="redroll", messages=CHAT, max_tokens=40, n=2, seed=11, stream=True, logprobs=True,
                       extra_body={"return_token_ids": True})
            whole = await collect(await a.chat.completions.create(**ask))  # (uninterrupted, no key)
            assert sum(engine.started.values()) == 2
            engine.started.clear()
            key = {"Idempotency-Key": "stream-7"}

            dropped = await a.chat.completions.create(**ask, extra_headers=key)
            seen = []
            async for chunk in dropped:
                seen.append(chunk)
                if any(ch.delta.content for ch in chunk.choices):
                    break
            await dropped.close()  # (the client goes away mid-stream)
            assert not any(ch.finish_reason for c in seen for ch in c.choices)
            await wait_until(lambda: len(engine.started) == 2, timeout=30)
            async with httpx.AsyncClient() as http:  # (the first gateway noticed: the call waits no more)
                await wait_until(lambda: waiting(http, one), timeout=30)

            retried = await collect(await b.chat.completions.create(**ask, extra_headers=key))
            assert texts(retried, chat=True) == texts(whole, chat=True)
            assert len(texts(whole, chat=True)) == 2 and all(t.count(" ") == 40 for t in texts(whole, chat=True).values())
            for i in (0, 1):
                ids = [t for c in retried for ch in c.choices if ch.index == i for t in ch.model_extra.get("token_ids") or []]
                assert ids == [t for c in whole for ch in c.choices if ch.index == i
                               for t in ch.model_extra.get("token_ids") or []]
            assert finishes(retried) == {0: finishes(retried)[0], 1: finishes(retried)[1]}
            assert all(f[-1] == "length" for f in finishes(retried).values())

            after = await collect(await a.chat.completions.create(**ask, extra_headers=key))  # (from the records)
            assert texts(after, chat=True) == texts(whole, chat=True)
            assert len(after) == 2 + 2  # (the two roles, then each choice whole in one chunk)
            assert sorted(engine.started.values()) == [1, 1]  # (each keyed request ran once)
    finally:
        one.stop()
        two.stop()


async def test_a_gateway_sigkilled_mid_stream_the_retry_on_another_gets_it_all(settings, gateway_log, sdk):
    """The gateway serving a keyed stream is SIGKILLed after its first chunks: the client's stream
    breaks, its retry (same Idempotency-Key, same body) on another gateway process streams the whole
    completion, equal to an uninterrupted run's, and each request was generated once."""
    engine = CountingEngine(token_ms=20)
    one, two = Served(settings, log=gateway_log), Served(settings, log=gateway_log)
    try:
        async with running(worker(settings, engine)):
            ask = dict(model="redroll", messages=CHAT, max_tokens=40, n=2, seed=5, stream=True)
            whole = await collect(await sdk(two).chat.completions.create(**ask))  # (uninterrupted, no key)
            engine.started.clear()
            key = {"Idempotency-Key": "killed-gateway"}
            broken = await sdk(one).chat.completions.create(**ask, extra_headers=key)
            with pytest.raises((openai.APIError, httpx.HTTPError)):
                async for chunk in broken:
                    if any(ch.delta.content for ch in chunk.choices) and one.proc.poll() is None:
                        one.kill()  # (SIGKILL: mid-stream, its requests in flight)
            assert one.proc.returncode == -9
            retried = await collect(await sdk(two).chat.completions.create(**ask, extra_headers=key))
            assert texts(retried, chat=True) == texts(whole, chat=True) and len(texts(whole, chat=True)) == 2
            assert sorted(engine.started.values()) == [1, 1]  # (each keyed request ran once)
    finally:
        one.stop()
        two.stop()
