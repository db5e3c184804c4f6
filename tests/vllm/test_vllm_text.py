"""Text in and out on vLLM itself: chats rendered with the checkpoint's chat template, vLLM's own
text, stop strings applied by vLLM. One engine for the module (a start costs tens of seconds)."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from redroll.engine_worker.engines.tiny_checkpoint import TINY_CHAT_TEMPLATE, save_tiny_checkpoint
from redroll.engine_worker.engines.vllm_engine import VLLMEngine
from redroll.producer.client import make_request
from redroll.shared.codec import ValidationError
from tests.vllm.conftest import engine_options

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a queue of requests"}]
GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tmp_path_factory):
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-chat"), 0, chat_template=TINY_CHAT_TEMPLATE)
    engine = VLLMEngine(str(path), **engine_options())
    await engine.start()
    yield engine
    await engine.close()


def rendered(tokenizer, messages):
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


async def test_a_chat_gets_vllms_text_of_its_ids_and_token_requests_none(engine):
    tokenizer = engine.tokenizer
    chat = make_request(request_id="chat", messages=CHAT, sampling_params=GREEDY)
    engine.validate(chat)
    ids_only = make_request(request_id="ids", input_ids=rendered(tokenizer, CHAT), sampling_params=GREEDY)
    a, b = await asyncio.gather(engine.generate(chat, "h-chat"), engine.generate(ids_only, "h-ids"))
    assert a.prompt_tokens == len(rendered(tokenizer, CHAT))
    assert a.samples[0].token_ids == b.samples[0].token_ids and len(a.samples[0].token_ids) == 24
    assert a.samples[0].text == tokenizer.decode(a.samples[0].token_ids, skip_special_tokens=True)
    assert b.samples[0].text is None  # (sent with detokenize=False)
    with pytest.raises(ValidationError) as ei:
        engine.validate(make_request(messages=[{"role": "assistant", "content": "hi"}]))
    assert ei.value.field == "messages" and "\n" not in str(ei.value)


async def test_a_stop_string_ends_the_sample_and_its_text_before_it(engine):
    tokenizer = engine.tokenizer
    full = await engine.generate(make_request(messages=CHAT, sampling_params=GREEDY), "h-full")
    ids, text = full.samples[0].token_ids, full.samples[0].text
    head = tokenizer.decode(ids[:6], skip_special_tokens=True)
    at = next(i for i in range(len(head), len(text)) if text[i:i + 3].isascii() and text[i:i + 3].isalpha())
    stop = text[at:at + 3]
    out = await engine.generate(make_request(messages=CHAT, sampling_params={**GREEDY, "stop": [stop]}), "h-stop")
    sample = out.samples[0]
    assert sample.finish_reason == "stop"
    end = len(sample.token_ids)
    assert sample.token_ids == ids[:end]  # up to and including the token that completed the stop string
    whole = tokenizer.decode(ids[:end], skip_special_tokens=True)
    assert stop in whole and stop not in tokenizer.decode(ids[:end - 1], skip_special_tokens=True)
    assert sample.text == whole[:whole.index(stop)]
