"""Text in and out end to end, through Redis: a producer's chat request, a worker that renders it
with the model's chat template, a record with the text; a worker whose tokenizer has none answers
with an error record naming ``messages``; a worker that knows only schema 1 hands a chat back for
a newer worker, which runs it."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from redroll.cli.batch_run import submit_file
from redroll.engine_worker.engines.synthetic import SyntheticEngine, SyntheticWords
from redroll.engine_worker.worker import Worker
from redroll.producer.client import Producer
from redroll.shared.codec import Limits
from redroll.shared.settings import Settings
from redroll.shared.types import RecordStatus
from tests.conftest import running, wait_until

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a queue of requests"}]


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from redroll.engine_worker.engines.tiny_checkpoint import TINY_CHAT_TEMPLATE, save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-chat"), seed=0, chat_template=TINY_CHAT_TEMPLATE)


async def test_a_chat_through_the_queue_comes_back_with_its_text(settings, chat_checkpoint):
    from transformers import AutoTokenizer

    from redroll.engine_worker.engines.transformers_engine import TransformersEngine

    tokenizer = AutoTokenizer.from_pretrained(str(chat_checkpoint))
    worker = Worker(settings, TransformersEngine(str(chat_checkpoint)), max_inflight=4, block_ms=200)
    greedy = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    async with running(worker), Producer(settings, block_ms=200) as producer:
        chat, ids_only = await asyncio.gather(
            producer.generate(request_id="chat-1", messages=CHAT, sampling_params=greedy, timeout=120),
            producer.generate(request_id="ids-1", input_ids=[5, 6, 7], sampling_params=greedy, timeout=120))
        assert chat.status is RecordStatus.FINISHED and chat.v == 2
        assert chat.output_text == [tokenizer.decode(chat.output_token_ids[0], skip_special_tokens=True)]
        rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
        assert chat.meta_info["prompt_tokens"] == len(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
        assert ids_only.status is RecordStatus.FINISHED and ids_only.output_text is None and ids_only.v == 1
        # a stop string: finish "stop", the text cut before it, the ids up to the token that completed it
        text = chat.output_text[0]
        at = next(i for i in range(len(text)) if text[i:i + 3].isascii() and text[i:i + 3].isalpha())
        stop = text[at:at + 3]
        stopped = await producer.generate(request_id="chat-2", messages=CHAT, sampling_params={**greedy, "stop": stop},
                                          timeout=120)
        assert stopped.finish_reasons == ["stop"]
        ids = stopped.output_token_ids[0]
        assert ids == chat.output_token_ids[0][:len(ids)]
        assert stopped.output_text == [text[:text.index(stop)]]


async def test_records_carry_the_prompt_ids_the_worker_rendered_with_a_requests_own_template(settings,
                                                                                             chat_checkpoint):
    """``return_prompt_token_ids`` (schema 4): a text prompt's ids as the worker tokenized it, a chat's
    as its template rendered it, the model's template or the request's own with its variables."""
    from transformers import AutoTokenizer

    from redroll.engine_worker.engines.transformers_engine import TransformersEngine

    tokenizer = AutoTokenizer.from_pretrained(str(chat_checkpoint))

    def rendered(**kwargs: Any) -> list[int]:
        out = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, **kwargs)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    own = "{% for m in messages %}[{{ m['role'] }}{% if shout %}!{% endif %}] {{ m['content'] }}{% endfor %}>"
    worker = Worker(settings, TransformersEngine(str(chat_checkpoint)), max_inflight=4, block_ms=200)
    sampling = {"max_new_tokens": 3, "temperature": 0.0}
    async with running(worker), Producer(settings, block_ms=200) as producer:
        text, chat, templated, plain = await asyncio.gather(
            producer.generate(prompt="The quick brown fox", return_prompt_token_ids=True, sampling_params=sampling,
                              timeout=120),
            producer.generate(messages=CHAT, return_prompt_token_ids=True, sampling_params=sampling, timeout=120),
            producer.generate(messages=CHAT, return_prompt_token_ids=True, chat_template=own,
                              chat_template_kwargs={"shout": True}, sampling_params=sampling, timeout=120),
            producer.generate(messages=CHAT, sampling_params=sampling, timeout=120))
        assert text.prompt_token_ids == tokenizer("The quick brown fox")["input_ids"]
        assert chat.prompt_token_ids == rendered() and chat.meta_info["prompt_tokens"] == len(rendered())
        assert templated.prompt_token_ids == rendered(chat_template=own, shout=True) != rendered()
        assert plain.prompt_token_ids is None and plain.status is RecordStatus.FINISHED  # (not asked: not carried)
        broken = await producer.generate(messages=CHAT, chat_template="{% for %}", timeout=120)
        assert broken.status is RecordStatus.ERROR and broken.error.startswith("invalid messages: the chat template")


async def test_synthetic_records_carry_prompt_ids_too(settings):
    """The synthetic engine counts a text prompt one token per byte: those are its prompt ids."""
    async with running(Worker(settings, SyntheticEngine(), max_inflight=4, block_ms=200)), \
            Producer(settings, block_ms=200) as producer:
        text, ids = await asyncio.gather(
            producer.generate(prompt="héllo", return_prompt_token_ids=True, timeout=60),
            producer.generate(input_ids=[9, 8, 7], return_prompt_token_ids=True, timeout=60))
        assert text.prompt_token_ids == list("héllo".encode()) and ids.prompt_token_ids == [9, 8, 7]


async def test_a_chat_for_a_model_without_a_chat_template_gets_an_error_record_naming_messages(settings):
    pytest.importorskip("torch")
    from redroll.engine_worker.engines.transformers_engine import TransformersEngine

    worker = Worker(settings, TransformersEngine(), max_inflight=4, block_ms=200)  # the byte tokenizer
    async with running(worker), Producer(settings, block_ms=200) as producer:
        rec = await producer.generate(request_id="chat-x", messages=CHAT, timeout=60)
        assert rec.status is RecordStatus.ERROR
        assert rec.error.startswith("invalid messages: ") and "no chat template" in rec.error and "\n" not in rec.error
        # the worker goes on: a text prompt runs, with its text
        ok = await producer.generate(request_id="text-1", prompt="hi", sampling_params={"max_new_tokens": 3}, timeout=60)
        assert ok.status is RecordStatus.FINISHED and len(ok.output_text) == 1


@dataclass(frozen=True)
class SchemaOneSettings(Settings):
    """Settings of a worker that knows only schema 1 (as one from before schema 2 would)."""

    @property
    def limits(self) -> Limits:
        return Limits(max_payload_bytes=self.max_payload_bytes, max_new_tokens=self.max_new_tokens,
                      max_n=self.max_n, schema_version=1)


async def test_a_schema_one_worker_hands_a_chat_back_and_a_newer_worker_runs_it(settings, r):
    settings = settings.with_(claim_idle_ms=300)
    old_settings = SchemaOneSettings(**{f: getattr(settings, f) for f in settings.__dataclass_fields__})
    old = Worker(old_settings, SyntheticEngine(token_ms=1, vocab_size=1000), max_inflight=8, block_ms=200)
    params: dict[str, Any] = {"max_new_tokens": 6}
    async with Producer(settings, block_ms=200) as producer:
        async with running(old):
            chat = await producer.submit(request_id="chat-v2", messages=CHAT, sampling_params=params)
            plain = await producer.generate(request_id="plain-v1", prompt="hi", sampling_params=params, timeout=30)
            assert plain.status is RecordStatus.FINISHED and plain.output_text is not None  # (it knows v 1)
            await wait_until(lambda: old.stats.handed_back >= 1, timeout=30)
            assert not chat.done() and await r.xlen(settings.keys.dead) == 0
        new = Worker(settings, SyntheticEngine(token_ms=1, vocab_size=1000), max_inflight=8, block_ms=200)
        async with running(new):
            rec = await asyncio.wait_for(chat, 30)
    assert rec.status is RecordStatus.FINISHED and rec.v == 2
    assert rec.output_text == [SyntheticWords().decode(rec.output_token_ids[0])]


async def test_redroll_submit_runs_chat_lines_and_writes_their_text(settings, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"request_id": "q1", "messages": CHAT, "sampling_params": {"max_new_tokens": 5}}) + "\n"
                   + json.dumps({"request_id": "q2", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 5}})
                   + "\n")
    worker = Worker(settings, SyntheticEngine(vocab_size=1000), max_inflight=8, block_ms=200)
    async with running(worker):
        assert await submit_file(settings, str(src), wait=True, out=str(out), progress=False, timeout=60) == 0
    records = {rec["request_id"]: rec for rec in map(json.loads, out.read_text().splitlines())}
    assert records["q1"]["output_text"] == [SyntheticWords().decode(records["q1"]["output_token_ids"][0])]
    assert records["q1"]["v"] == 2 and records["q2"]["output_text"] is None
