"""``redroll serve`` driven as clients drive it: the official ``openai`` SDK (sync and async) and
``curl``, against synthetic workers that count their generations (and, where torch is installed,
a transformers worker on the tiny checkpoint with a chat template)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from redroll.engine_worker.worker import Worker  # noqa: E402
from redroll.shared.settings import Settings  # noqa: E402
from tests.conftest import running, start_test_server, wait_until  # noqa: E402
from tests.gateway_support import CountingEngine, Served  # noqa: E402

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a queue of requests"}]


def curl(*args: str) -> tuple[int, dict, str]:
    """``curl -s`` a call; (HTTP status, JSON body, the response's headers as text)."""
    with tempfile.NamedTemporaryFile("r") as headers:
        out = subprocess.run(["curl", "-s", "-D", headers.name, "-w", "\n%{http_code}", "--max-time", "60", *args],
                             capture_output=True, text=True, timeout=90).stdout
        head = Path(headers.name).read_text()
    body, _, status = out.rpartition("\n")
    return int(status), json.loads(body) if body.strip() else {}, head


needs_curl = pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")


@pytest.fixture
def gateway_log(tmp_path: Path) -> Path:
    return tmp_path / "serve.log"


@pytest.fixture
async def sdk():
    """``sdk(gateway)``: an async openai client of that gateway (no SDK retries: the tests retry)."""
    made = []

    def client(gateway: Served) -> "openai.AsyncOpenAI":
        made.append(openai.AsyncOpenAI(base_url=gateway.v1, api_key="unused", max_retries=0))
        return made[-1]
    yield client
    for c in made:
        await c.close()


async def test_completions_and_chat_through_the_sdk(settings, gateway_log, sdk):
    """n = 4 samples with logprobs and token ids, a token-id prompt, a list of prompts, stop strings,
    usage and the weight version: with the async client and the sync one."""
    engine = CountingEngine()
    gateway = Served(settings, log=gateway_log)
    try:
        async with running(Worker(settings, engine, max_inflight=16, block_ms=200)):
            client = sdk(gateway)
            models = await client.models.list()
            assert [m.id for m in models.data] == ["redroll"]
            four = await client.completions.create(model="redroll", prompt="the queue", max_tokens=6, n=4, logprobs=0,
                                                   seed=7, extra_body={"return_token_ids": True})
            assert len(four.choices) == 4 and {c.index for c in four.choices} == {0, 1, 2, 3}
            for choice in four.choices:
                extra = choice.model_extra
                assert len(extra["token_ids"]) == 6 == len(choice.logprobs.token_logprobs)
                assert choice.logprobs.tokens == [f"token_id:{t}" for t in extra["token_ids"]]
                assert choice.text and choice.finish_reason == "length" and extra["weight_version"] == "0"
            assert four.usage.completion_tokens == 24 and four.usage.prompt_tokens == len("the queue")
            again = await client.completions.create(model="redroll", prompt="the queue", max_tokens=6, n=4,
                                                    logprobs=0, seed=7, extra_body={"return_token_ids": True})
            assert [c.text for c in again.choices] == [c.text for c in four.choices]  # (seeded)

            ids = await client.completions.create(model="redroll", prompt=[5, 6, 7], max_tokens=3,
                                                  extra_body={"return_token_ids": True})
            assert ids.choices[0].model_extra["prompt_token_ids"] == [5, 6, 7]
            assert ids.usage.prompt_tokens == 3
            batch = await client.completions.create(model="redroll", prompt=["one", "two", "three"], max_tokens=2, n=2)
            assert len(batch.choices) == 6 and batch.usage.completion_tokens == 12

            chat = await client.chat.completions.create(model="redroll", messages=CHAT, max_completion_tokens=8,
                                                        logprobs=True, seed=3)
            assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
            assert len(chat.choices[0].logprobs.content) == 8
            # a stop string: the text ends before it, finish "stop" (the synthetic engine spells ids as words)
            words = chat.choices[0].message.content.split()
            stop = " " + words[2]
            stopped = await client.chat.completions.create(model="redroll", messages=CHAT, max_tokens=8,
                                                           logprobs=True, stop=[stop], seed=3)
            assert stopped.choices[0].finish_reason == "stop"
            assert stop not in stopped.choices[0].message.content
            assert chat.choices[0].message.content.startswith(stopped.choices[0].message.content)

            def sync_calls() -> tuple:
                sync = openai.OpenAI(base_url=gateway.v1, api_key="unused", max_retries=0)
                c = sync.completions.create(model="redroll", prompt="sync", max_tokens=4)
                m = sync.chat.completions.create(model="redroll", messages=CHAT, max_tokens=4, n=2)
                return c, m

            c, m = await asyncio.to_thread(sync_calls)
            assert c.usage.completion_tokens == 4 and len(m.choices) == 2
    finally:
        gateway.stop()


async def test_an_idempotent_retry_generates_nothing_twice(settings, gateway_log, sdk):
    """The same Idempotency-Key, on two replicas, while running and after: one generation, one
    response; the key reused for another body is refused."""
    engine = CountingEngine(token_ms=20)
    one, two = Served(settings, log=gateway_log), Served(settings, log=gateway_log)
    try:
        async with running(Worker(settings, engine, max_inflight=16, block_ms=200)):
            a = sdk(one)
            b = sdk(two)
            key = {"Idempotency-Key": "order-66"}
            # concurrently on both replicas (the second attaches to the first's running request)
            first, second = await asyncio.gather(
                a.completions.create(model="redroll", prompt="once", max_tokens=10, n=4, extra_headers=key),
                b.completions.create(model="redroll", prompt="once", max_tokens=10, n=4, extra_headers=key))
            later = await b.completions.create(model="redroll", prompt="once", max_tokens=10, n=4, extra_headers=key)
            assert first.model_dump() == second.model_dump() == later.model_dump()
            assert sum(engine.started.values()) == 1
            for other in ("another", ["once", "and more prompts"]):
                with pytest.raises(openai.UnprocessableEntityError) as refused:
                    await a.completions.create(model="redroll", prompt=other, max_tokens=10, extra_headers=key)
                assert refused.value.body["param"] == "Idempotency-Key"
            assert sum(engine.started.values()) == 1  # (the reused key ran nothing)
            # without a key, each call is its own
            await a.completions.create(model="redroll", prompt="once", max_tokens=10)
            await a.completions.create(model="redroll", prompt="once", max_tokens=10)
            assert sum(engine.started.values()) == 3
    finally:
        one.stop()
        two.stop()


@pytest.mark.slow
async def test_a_gateway_killed_mid_call_loses_nothing(settings, gateway_log, sdk):
    """Must-show 3: a gateway SIGKILLed with calls in flight; the clients retry with the same
    Idempotency-Key on another gateway process and get their completions, each generated once."""
    engine = CountingEngine(token_ms=50)
    doomed, other = Served(settings, log=gateway_log), Served(settings, log=gateway_log)
    calls = 8
    try:
        async with running(Worker(settings, engine, max_inflight=16, block_ms=200)):
            a = sdk(doomed)
            b = sdk(other)

            async def call(client, i: int):
                return await client.chat.completions.create(
                    model="redroll", messages=[{"role": "user", "content": f"question {i}"}], max_tokens=40,
                    extra_headers={"Idempotency-Key": f"call-{i}"})

            in_flight = [asyncio.create_task(call(a, i)) for i in range(calls)]
            await wait_until(lambda: len(engine.started) == calls, timeout=60)
            doomed.kill()  # SIGKILL: every call is running on the worker, none answered yet
            for task in in_flight:
                with pytest.raises(openai.APIConnectionError):
                    await task
            retried = await asyncio.gather(*(call(b, i) for i in range(calls)))
            assert all(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 40 for r in retried)
            assert len(engine.started) == calls and set(engine.started.values()) == {1}
            again = await asyncio.gather(*(call(b, i) for i in range(calls)))
            assert [r.model_dump() for r in again] == [r.model_dump() for r in retried]
            assert set(engine.started.values()) == {1}
    finally:
        doomed.stop()
        other.stop()


async def test_session_turns_land_on_one_worker(redis_server, namespace, gateway_log, sdk):
    """With affinity lanes on, the turns of one session (X-Session-Id, or the user field) carry one
    affinity key and run on one worker."""
    settings = Settings(redis_url=redis_server.url, namespace=namespace, affinity_lanes=4, claim_idle_ms=1500,
                        heartbeat_s=0.5, max_deliveries=3)
    engines = [CountingEngine(token_ms=1) for _ in range(2)]
    workers = [Worker(settings, e, max_inflight=8, block_ms=100, name=f"w{i}") for i, e in enumerate(engines)]
    gateway = Served(settings, "--affinity-lanes", "4", log=gateway_log)
    try:
        async with running(*workers):
            await wait_until(lambda: all(w.lanes is not None and len(w.lanes.owned) == 2 for w in workers), 20)
            await asyncio.sleep(0.3)  # (blocking reads issued before the last ownership change have returned)
            client = sdk(gateway)
            for session in ("alice", "bob", "carol"):
                messages = [{"role": "user", "content": "hello"}]
                for turn in range(4):
                    reply = await client.chat.completions.create(
                        model="redroll", messages=messages, max_tokens=3,
                        extra_headers={"X-Session-Id": session})
                    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                                 {"role": "user", "content": f"turn {turn}"}]
                ran_on = {i for i, e in enumerate(engines) for rid in e.started}
                keys = {e.affinity[rid] for e in engines for rid in e.started}
                assert len(ran_on) == 1 and len(keys) == 1, (session, ran_on, keys)
                for e in engines:
                    e.started.clear()
                    e.affinity.clear()
            await client.chat.completions.create(model="redroll", messages=CHAT, max_tokens=3, user="dave")
            assert {e.affinity[r] for e in engines for r in e.started} == {
                __import__("redroll.web.gateway.translate", fromlist=["session_key"]).session_key("dave")}
    finally:
        gateway.stop()


@needs_curl
async def test_error_shapes(settings, tmp_path, gateway_log):
    """400 naming the field, 401 without or with a wrong key, 404 for another model, 429 with
    Retry-After over the backlog bound, all in OpenAI's error shape (raw HTTP, with curl)."""
    keys = tmp_path / "keys"
    keys.write_text("# the team's keys\nsecret-1\n")
    gateway = Served(settings, "--api-key-file", str(keys), "--max-backlog", "1", "--host", "127.0.0.1",
                     log=gateway_log)
    url = gateway.v1
    auth = ["-H", "Authorization: Bearer secret-1", "-H", "Content-Type: application/json"]
    try:
        status, body, _ = curl(f"{url}/models")
        assert status == 401 and body["error"]["type"] == "authentication_error"
        status, body, _ = curl(f"{url}/models", "-H", "Authorization: Bearer nope")
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert curl(f"{url}/models", *auth)[0] == 200
        for payload, param in (({"prompt": "x", "max_tokens": -1}, "max_tokens"),
                               ({"prompt": "x", "temperature": "hot"}, "temperature"),
                               ({"prompt": [1, "a"]}, "prompt[0]"),
                               ({"max_tokens": 3}, "prompt"),
                               ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
                               ({"prompt": "x", "n": 1000}, "n")):
            status, body, _ = curl(f"{url}/completions", *auth, "-d", json.dumps(payload))
            assert status == 400, (payload, body)
            assert set(body["error"]) == {"message", "type", "param", "code"}
            assert body["error"]["param"] == param and param in body["error"]["message"], body
        status, body, _ = curl(f"{url}/chat/completions", *auth, "-d", json.dumps(
            {"messages": CHAT, "max_completion_tokens": 10**9}))
        assert status == 400 and body["error"]["param"] == "max_completion_tokens", body
        status, body, _ = curl(f"{url}/completions", *auth, "-d", json.dumps({"model": "gpt-9", "prompt": "x"}))
        assert status == 404 and body["error"]["param"] == "model"
        # no worker: one call waits, the next is over the bound
        waiting = subprocess.Popen(["curl", "-s", "--max-time", "60", f"{url}/completions", *auth, "-d",
                                    json.dumps({"prompt": "wait", "max_tokens": 2})], stdout=subprocess.DEVNULL)
        try:
            def over_bound() -> bool:
                return curl(f"{gateway.url}/health")[1].get("waiting") == 1
            await wait_until(over_bound, timeout=30)
            status, body, head = curl(f"{url}/completions", *auth, "-d", json.dumps({"prompt": "x"}))
            assert status == 429 and body["error"]["type"] == "rate_limit_error"
            assert "retry-after: 1" in head.lower()
        finally:
            waiting.kill()
            waiting.wait()
    finally:
        gateway.stop()


@needs_curl
async def test_429_when_the_pipeline_backlog_is_over_the_bound(settings, r, gateway_log):
    """--max-queued: the pipeline's queued requests (any producer's) over the bound refuse new calls."""
    from redroll.producer.client import make_request, send

    gateway = Served(settings, "--max-queued", "2", log=gateway_log)
    try:
        assert curl(f"{gateway.v1}/models")[0] == 200
        await send(settings, r, [make_request(prompt="queued", sampling_params={"max_new_tokens": 2})
                                 for _ in range(2)])
        await wait_until(lambda: curl(f"{gateway.url}/health")[1].get("queued") == 2, timeout=30)
        status, body, head = curl(f"{gateway.v1}/completions", "-H", "Content-Type: application/json", "-d",
                                  json.dumps({"prompt": "x"}))
        assert status == 429 and body["error"]["code"] == "queue_full" and "retry-after: 1" in head.lower()
    finally:
        gateway.stop()


async def test_the_gateway_runs_with_only_its_acl_user(gateway_log, sdk):
    """redroll serve as the ``gateway`` ACL role (a worker as ``worker``): plain and keyed calls,
    streamed too, --max-queued's backlog reads, and not one denial in ACL LOG."""
    import uuid

    import redis

    from redroll.security.acl import setuser_args
    from redroll.shared.functions import LIBRARY_SOURCE

    server = start_test_server()
    ns = "gwacl" + uuid.uuid4().hex[:6]
    try:
        admin = redis.Redis(port=server.port)
        admin.function_load(LIBRARY_SOURCE, replace=True)  # (the roles may not: an administrator loads it)
        version = admin.info("server")["redis_version"]
        users = {}
        for role in ("gateway", "worker"):
            password = uuid.uuid4().hex
            admin.execute_command("ACL", "SETUSER", *setuser_args(f"{role}-{ns}", password, role, ns,
                                                                  server_version=version))
            users[role] = Settings(redis_url=server.url, namespace=ns, redis_username=f"{role}-{ns}",
                                   redis_password=password)
        gateway = Served(users["gateway"], "--max-queued", "100", log=gateway_log,
                         REDROLL_REDIS_USERNAME=f"gateway-{ns}", REDROLL_REDIS_PASSWORD=users["gateway"].redis_password)
        try:
            async with running(Worker(users["worker"], CountingEngine(), max_inflight=8, block_ms=200)):
                client = sdk(gateway)
                plain = await client.completions.create(model="redroll", prompt="x", max_tokens=3)
                keyed = await client.chat.completions.create(model="redroll", messages=CHAT, max_tokens=3,
                                                             extra_headers={"Idempotency-Key": "acl-1"})
                again = await client.chat.completions.create(model="redroll", messages=CHAT, max_tokens=3,
                                                             extra_headers={"Idempotency-Key": "acl-1"})
                assert plain.usage.completion_tokens == 3 and keyed.model_dump() == again.model_dump()
                for key in (None, "acl-2"):  # (streamed: the chunks read with the gateway role's grants)
                    chunks = [c async for c in await client.chat.completions.create(
                        model="redroll", messages=CHAT, max_tokens=3, n=2, stream=True,
                        extra_headers={"Idempotency-Key": key} if key else None)]
                    assert {c.choices[0].finish_reason for c in chunks if c.choices} >= {"length"}
                await asyncio.sleep(1.5)  # (a health ping that reads the backlog)
        finally:
            gateway.stop()
        denials = [e for e in admin.acl_log(count=1000) if ns in str(e.get("username"))]
        assert denials == []
        admin.close()
    finally:
        server.stop()
        shutil.rmtree(server.directory, ignore_errors=True)


@needs_curl
async def test_503_while_redis_is_unreachable(tmp_path, gateway_log):
    """A gateway whose Redis goes away answers 503 with Retry-After (and /health says so); one
    started while Redis is down answers 503 too, and serves once Redis is back."""
    server = start_test_server()
    settings = Settings(redis_url=server.url, namespace="gw503")
    gateway = Served(settings, log=gateway_log)
    late = None
    try:
        server.stop()
        await wait_until(lambda: curl(f"{gateway.url}/health")[0] == 503, timeout=30)
        status, body, head = curl(f"{gateway.v1}/completions", "-H", "Content-Type: application/json", "-d",
                                  json.dumps({"prompt": "x"}))
        assert status == 503 and body["error"]["code"] == "unavailable" and "retry-after" in head.lower()
        late = Served(settings, log=gateway_log, healthy=False)
        status, body, _ = curl(f"{late.v1}/chat/completions", "-H", "Content-Type: application/json", "-d",
                               json.dumps({"messages": CHAT}))
        assert status == 503 and body["error"]["code"] == "unavailable"
        again = start_test_server(port=server.port)
        try:
            await wait_until(lambda: curl(f"{late.url}/health")[0] == 200, timeout=30)
            await wait_until(lambda: curl(f"{gateway.url}/health")[0] == 200, timeout=30)
        finally:
            again.stop()
            shutil.rmtree(again.directory, ignore_errors=True)
    finally:
        gateway.stop()
        if late is not None:
            late.stop()
        shutil.rmtree(server.directory, ignore_errors=True)


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from redroll.engine_worker.engines.tiny_checkpoint import TINY_CHAT_TEMPLATE, save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-chat"), seed=0, chat_template=TINY_CHAT_TEMPLATE)


async def test_a_transformers_worker_behind_the_gateway(settings, chat_checkpoint, gateway_log, sdk):
    """A real model path: chat rendered with the tiny checkpoint's template; text equals the ids decoded."""
    from transformers import AutoTokenizer

    from redroll.engine_worker.engines.transformers_engine import TransformersEngine

    tokenizer = AutoTokenizer.from_pretrained(str(chat_checkpoint))
    gateway = Served(settings, log=gateway_log)
    try:
        async with running(Worker(settings, TransformersEngine(str(chat_checkpoint)), max_inflight=4, block_ms=200)):
            client = sdk(gateway)
            chat = await client.chat.completions.create(
                model="redroll", messages=CHAT, max_tokens=8, temperature=0.0, logprobs=True,
                extra_body={"return_token_ids": True, "ignore_eos": True}, timeout=120)
            choice = chat.choices[0]
            ids = choice.model_extra["token_ids"]
            assert len(ids) == 8 and choice.message.content == tokenizer.decode(ids, skip_special_tokens=True)
            assert [c.token for c in choice.logprobs.content] == [f"token_id:{t}" for t in ids]
            text = await client.completions.create(model="redroll", prompt=[3, 4, 5], max_tokens=4, n=4,
                                                   extra_body={"ignore_eos": True}, timeout=120)
            assert len(text.choices) == 4 and text.usage.completion_tokens == 16
    finally:
        gateway.stop()
