"""Text in and out in the engines: chat requests rendered with the model's chat template, each
sample's text decoded from its ids, stop strings ending a sample where its text reaches one."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from redroll.engine_worker.engines.base import EngineOutput
from redroll.engine_worker.engines.synthetic import SyntheticEngine, SyntheticWords
from redroll.producer.client import make_request
from redroll.shared.codec import ValidationError
from redroll.shared.types import GenerationRequest
from tests.conftest import started

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a queue of requests"}]


# ---------------------------------------------------------------- the cut


def test_the_text_is_cut_at_the_earliest_stop_string():
    from redroll.engine_worker.engines.text import find_stop, trim_stop
    from redroll.shared.types import SamplingParams

    params = SamplingParams(stop=("END", "b"))
    assert find_stop("a b END", params.stop) == (2, "b") and find_stop("abc", ("x",)) is None
    assert find_stop("xENDy", ("ND", "END")) == (1, "END")  # earliest start wins, whatever the order
    assert trim_stop("a b END", params, "stop") == "a "
    assert trim_stop("a ", params, "stop") == "a "  # an engine's text already cut: unchanged
    assert trim_stop("a b END", params, "length") == "a b END"  # not ended by a stop string
    kept = SamplingParams(stop=("END",), no_stop_trim=True)
    assert trim_stop("x ENDing", kept, "stop") == "x END"  # kept, and cut after it (as vLLM and SGLang)


# ---------------------------------------------------------------- the synthetic engine


async def synthetic(request: GenerationRequest) -> EngineOutput:
    engine = SyntheticEngine(vocab_size=1000)
    engine.validate(request)
    return await engine.generate(request, request.request_id)


async def test_synthetic_chat_gives_text_spelled_from_its_ids():
    words = SyntheticWords()
    out = await synthetic(make_request(request_id="c", messages=CHAT, sampling_params={"max_new_tokens": 12, "n": 2}))
    for sample in out.samples:
        assert len(sample.token_ids) == 12 and sample.finish_reason == "length"
        assert sample.text == words.decode(sample.token_ids)
    again = await synthetic(make_request(request_id="c", messages=CHAT, sampling_params={"max_new_tokens": 12, "n": 2}))
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in out.samples]  # the chat is the input
    other = await synthetic(make_request(request_id="c", messages=CHAT[1:], sampling_params={"max_new_tokens": 12}))
    assert other.samples[0].token_ids != out.samples[0].token_ids


async def test_synthetic_text_only_when_asked_by_default_for_text_prompts():
    assert (await synthetic(make_request(input_ids=[1, 2]))).samples[0].text is None
    assert (await synthetic(make_request(input_ids=[1, 2], return_text=True))).samples[0].text is not None
    assert (await synthetic(make_request(prompt="hi"))).samples[0].text is not None
    assert (await synthetic(make_request(prompt="hi", return_text=False))).samples[0].text is None


async def test_synthetic_stop_strings_end_the_sample_at_the_token_that_completes_one():
    words = SyntheticWords()
    full = (await synthetic(make_request(request_id="s", prompt="go", sampling_params={"max_new_tokens": 40})))
    ids = full.samples[0].token_ids
    stop = words.decode(ids[9:11]).strip()  # two words from the middle: "w1 w2"
    out = await synthetic(make_request(request_id="s", prompt="go",
                                       sampling_params={"max_new_tokens": 40, "stop": [stop]}))
    sample = out.samples[0]
    assert sample.finish_reason == "stop"
    end = len(sample.token_ids)
    assert sample.token_ids == ids[:end] and end <= 11
    assert stop in words.decode(ids[:end]) and stop not in words.decode(ids[:end - 1])  # the completing token
    assert sample.text == words.decode(ids[:end])[:words.decode(ids[:end]).index(stop)]  # cut before it
    kept = await synthetic(make_request(request_id="s", prompt="go",
                                        sampling_params={"max_new_tokens": 40, "stop": [stop], "no_stop_trim": True}))
    assert kept.samples[0].text == words.decode(ids[:end]) and kept.samples[0].text.endswith(stop)


# ---------------------------------------------------------------- the transformers engine


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from redroll.engine_worker.engines.tiny_checkpoint import TINY_CHAT_TEMPLATE, save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-chat"), seed=0, chat_template=TINY_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def tokenizer(chat_checkpoint: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(chat_checkpoint))


@pytest.fixture
async def engine(chat_checkpoint: Path) -> AsyncIterator[Any]:
    from redroll.engine_worker.engines.transformers_engine import TransformersEngine

    async with started(TransformersEngine(str(chat_checkpoint))) as eng:
        yield eng


def greedy(max_new_tokens: int = 16, **more: Any) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True, **more}


def rendered(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


async def test_a_chat_runs_on_its_rendered_prompt_and_returns_the_decoded_text(engine, tokenizer):
    chat = make_request(request_id="chat", messages=CHAT, sampling_params=greedy())
    by_ids = make_request(request_id="ids", input_ids=rendered(tokenizer, CHAT), sampling_params=greedy(),
                          return_text=True)
    engine.validate(chat)
    a, b = await asyncio.gather(engine.generate(chat, "chat"), engine.generate(by_ids, "ids"))
    assert a.prompt_tokens == len(rendered(tokenizer, CHAT))
    assert a.samples[0].token_ids == b.samples[0].token_ids and len(a.samples[0].token_ids) == 16
    assert a.samples[0].text == tokenizer.decode(a.samples[0].token_ids, skip_special_tokens=True)
    assert a.samples[0].text == b.samples[0].text
    # tools go to the template
    tools = [{"type": "function", "function": {"name": "lookup"}}]
    with_tools = await engine.generate(make_request(messages=CHAT, tools=tools, sampling_params=greedy(1)), "t")
    assert with_tools.prompt_tokens == len(rendered(tokenizer, CHAT, tools=tools)) > a.prompt_tokens


async def test_token_id_requests_carry_no_text_unless_asked(engine):
    out = await engine.generate(make_request(input_ids=[5, 6, 7], sampling_params=greedy(4)), "h")
    assert out.samples[0].text is None


async def test_a_stop_string_ends_the_sample_and_its_text_before_it(engine, tokenizer):
    full = await engine.generate(make_request(messages=CHAT, sampling_params=greedy(24)), "full")
    ids = full.samples[0].token_ids
    head = tokenizer.decode(ids[:6], skip_special_tokens=True)
    text = full.samples[0].text
    # three letters after the first six tokens (not a replacement character of a split byte)
    at = next(i for i in range(len(head), len(text)) if text[i:i + 3].isascii() and text[i:i + 3].isalpha())
    stop = text[at:at + 3]
    out = await engine.generate(make_request(messages=CHAT, sampling_params=greedy(24, stop=[stop])), "stop")
    sample = out.samples[0]
    assert sample.finish_reason == "stop"
    end = len(sample.token_ids)
    assert sample.token_ids == ids[:end]  # up to and including the token that completed the stop string
    whole = tokenizer.decode(ids[:end], skip_special_tokens=True)
    assert stop in whole and stop not in tokenizer.decode(ids[:end - 1], skip_special_tokens=True)
    assert sample.text == whole[:whole.index(stop)] and stop not in sample.text


async def test_a_template_that_refuses_the_chat_is_a_one_line_error_naming_messages(engine):
    with pytest.raises(ValidationError) as ei:
        engine.validate(make_request(messages=[{"role": "assistant", "content": "hello"}]))
    assert ei.value.field == "messages" and "must not be the assistant's" in ei.value.rule
    assert "\n" not in str(ei.value)


async def test_a_tokenizer_without_a_chat_template_refuses_chats_naming_messages():
    pytest.importorskip("torch")
    from redroll.engine_worker.engines.transformers_engine import TransformersEngine

    async with started(TransformersEngine()) as byte_engine:  # the built-in tiny model's byte tokenizer
        with pytest.raises(ValidationError) as ei:
            byte_engine.validate(make_request(messages=CHAT))
        assert ei.value.field == "messages" and "no chat template" in ei.value.rule and "\n" not in str(ei.value)
        # its text prompts still get their text
        out = await byte_engine.generate(make_request(prompt="hi", sampling_params=greedy(5)), "p")
        assert out.samples[0].text == byte_engine.tokenizer.decode(out.samples[0].token_ids)


# ---------------------------------------------------------------- SGLang (the stand-in: contract only)


class _ChatStandInTokenizer:
    """The stand-in's byte tokenizer with a chat template, rendered as ``<role>content`` lines."""

    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def apply_chat_template(self, messages, *, tools=None, add_generation_prompt=False, tokenize=False):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + ("<assistant>" if add_generation_prompt else "")
        return self.inner.encode(text) if tokenize else text


def letters(prompt_ids, position, seed, vocab):
    """The stand-in's token at ``position``: the byte ``a`` + position (its ids are bytes + 3)."""
    return ord("a") + 3 + position


async def sglang_engine(**kwargs: Any) -> Any:
    from redroll.engine_worker.engines.sglang_engine import SGLangEngine
    from tests import sglang_standin as sgl

    engine = SGLangEngine("/models/tiny", engine_factory=sgl.Engine.with_options(token_fn=letters), **kwargs)
    await engine.start()
    return engine


async def test_sglang_gets_a_chat_as_rendered_ids_and_gives_its_text():
    engine = await sglang_engine()
    try:
        engine.tokenizer = _ChatStandInTokenizer(engine.tokenizer)
        chat = make_request(messages=CHAT, sampling_params={"max_new_tokens": 12, "n": 2})
        engine.validate(chat)
        out = await engine.generate(chat, "h-chat")
        calls = engine.engine.calls[-2:]
        expected = engine.tokenizer.apply_chat_template(chat_messages_of(CHAT), add_generation_prompt=True,
                                                        tokenize=True)
        assert all(c["input_ids"] == expected and c["prompt"] is None for c in calls)
        for sample in out.samples:
            assert sample.text == engine.tokenizer.decode(sample.token_ids) == "abcdefghijkl"
        # a stop string: the text ends before it, the ids run to the token that completed it
        stopped = await engine.generate(make_request(messages=CHAT, sampling_params={
            "max_new_tokens": 12, "stop": ["ef"]}), "h-stop")
        sample = stopped.samples[0]
        assert sample.finish_reason == "stop"
        assert engine.tokenizer.decode(sample.token_ids) == "abcdef" and sample.text == "abcd"
        # token-id requests carry no text unless asked
        assert (await engine.generate(make_request(input_ids=[5, 6]), "h-ids")).samples[0].text is None
    finally:
        await engine.close()


async def test_sglang_sends_a_text_prompt_as_the_ids_its_record_names_when_asked_for_them():
    engine = await sglang_engine()
    try:
        engine.tokenizer = _ChatStandInTokenizer(engine.tokenizer)
        out = await engine.generate(make_request(prompt="hey", return_prompt_token_ids=True), "h-text")
        assert out.prompt_token_ids == engine.tokenizer.encode("hey") == engine.engine.calls[-1]["input_ids"]
        chat = await engine.generate(make_request(messages=CHAT, return_prompt_token_ids=True), "h-chat")
        assert chat.prompt_token_ids == engine.engine.calls[-1]["input_ids"]
        plain = await engine.generate(make_request(prompt="hey"), "h-plain")  # (not asked: SGLang tokenizes)
        assert plain.prompt_token_ids is None and engine.engine.calls[-1]["prompt"] == "hey"
    finally:
        await engine.close()


def chat_messages_of(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [dict(m) for m in messages]


async def test_sglang_without_a_tokenizer_refuses_chats_and_text_naming_the_field():
    engine = await sglang_engine(skip_tokenizer_init=True)
    try:
        for request, field in ((make_request(messages=CHAT), "messages"),
                               (make_request(input_ids=[5], return_text=True), "return_text")):
            with pytest.raises(ValidationError) as ei:
                engine.validate(request)
            assert ei.value.field == field and "\n" not in str(ei.value)
        engine.validate(make_request(input_ids=[5]))
    finally:
        await engine.close()
