"""Token-exact sessions through the Python API: a 5-turn chat on a transformers worker (a tiny
ChatML checkpoint, random weights, greedy), each turn's prompt as the engine ran it
(``prompt_token_ids`` in its record) equal to the previous turn's prompt + completion + the new
messages' ids (the template's end of the assistant turn, then the new part alone); some completion
re-encodes to other ids, so a re-rendered conversation would have drifted."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from redroll.engine_worker.engines.tiny_agent import save_agent_checkpoint  # noqa: E402
from redroll.engine_worker.engines.transformers_engine import TransformersEngine  # noqa: E402
from redroll.engine_worker.worker import Worker  # noqa: E402
from redroll.producer import Producer  # noqa: E402
from redroll.shared.types import RecordStatus  # noqa: E402
from tests.conftest import running  # noqa: E402

TURNS = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
         [{"role": "user", "content": "And then?"}],
         [{"role": "tool", "content": "42"}],
         [{"role": "user", "content": "Grüße, café"}],
         [{"role": "user", "content": "Bye"}]]


def new_part(tokenizer, conversation_ids: list[int], messages: list[dict]) -> list[int]:
    """What the test expects after the conversation: the template's ``<|im_end|>\\n`` (minus an
    ``<|im_end|>`` the completion ended with), then the new messages as ChatML renders them."""
    closing = tokenizer.encode("<|im_end|>\n", add_special_tokens=False)
    written = 1 if conversation_ids[-1:] == closing[:1] else 0
    text = "".join(f"<|im_start|>{m['role'] if m['role'] != 'tool' else 'user'}\n"
                   + (f"<tool_response>\n{m['content']}\n</tool_response>" if m["role"] == "tool" else m["content"])
                   + "<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"
    return closing[written:] + tokenizer.encode(text, add_special_tokens=False)


async def test_five_turns_are_token_exact(settings, tmp_path):
    from transformers import AutoTokenizer

    checkpoint = save_agent_checkpoint(tmp_path / "chatml", "hermes", seed=1)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    worker = Worker(settings, TransformersEngine(str(checkpoint), prefix_cache_tokens=8192), max_inflight=4,
                    block_ms=100, name="w0")
    async with running(worker), Producer(settings) as producer:
        session = producer.session("s5")
        records = []
        for k, messages in enumerate(TURNS):
            before = list(session.conversation)
            rec = await session.turn(messages=messages, sampling_params={"max_new_tokens": 8 + k, "temperature": 0})
            assert rec.status is RecordStatus.FINISHED, rec.error
            if k == 0:
                assert rec.prompt_token_ids == list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                                  return_dict=True)["input_ids"])
            else:
                assert rec.prompt_token_ids == before + new_part(tokenizer, before, messages), k
                assert rec.meta_info["cached_tokens"] >= len(before) - 1  # (the worker held the conversation)
            assert session.conversation == rec.prompt_token_ids + rec.output_token_ids[0]
            records.append(rec)
    drifted = [r for r in records
               if tokenizer.encode(tokenizer.decode(r.output_token_ids[0]), add_special_tokens=False)
               != r.output_token_ids[0]]
    assert drifted, "no completion re-encodes to other ids: the test proves nothing (change the seed)"
