"""Token-exact sessions through the Python API: a 5-turn chat on a transformers worker (a tiny
ChatML checkpoint, random weights, greedy), each turn's prompt as the engine ran it
(``prompt_token_ids`` in its record) equal to the previous turn's prompt + completion + the new
messages' ids (the template's end of the assistant turn, then the new part alone); some completion
re-encodes to other ids, so a re-rendered conversation would have drifted."""

from __future__ import annotations

import asyncio

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


GATEWAY_TURNS = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
                 [{"role": "user", "content": "And then?"}],
                 [{"role": "user", "content": "Grüße, café"}],
                 [{"role": "user", "content": "Say more."}],
                 [{"role": "user", "content": "Bye"}]]


async def streamed_turn(client, **call) -> dict:
    """A streamed call's turn, rebuilt from its chunks (the prompt ids come with the last)."""
    turn = {"prompt": None, "completion": [], "text": "", "finish": None}
    async for chunk in await client.chat.completions.create(stream=True, **call):
        turn["prompt"] = (chunk.model_extra or {}).get("prompt_token_ids") or turn["prompt"]
        for choice in chunk.choices:
            turn["completion"] += (choice.model_extra or {}).get("token_ids") or []
            turn["text"] += choice.delta.content or ""
            turn["finish"] = choice.finish_reason or turn["finish"]
    return turn


async def gateway_session(client, name: str, turns=GATEWAY_TURNS, before_turn=None, streamed=()) -> list[dict]:
    """A session through the gateway with the openai SDK, as an agent framework runs one: the whole
    conversation every call (the replies as returned), the session named by X-Session-Id; per turn
    the ids the response carries. ``before_turn(k, start)``: run before turn k (``start()``
    begins the call and returns its task); ``streamed``: the turns called with ``stream``."""
    conversation: list[dict] = []
    turns_out = []
    for k, messages in enumerate(turns):
        conversation += messages
        call = dict(model="chatml", messages=list(conversation), temperature=0.0, max_tokens=8 + k,
                    extra_headers={"X-Session-Id": name})

        async def one(call=call, stream=k in streamed) -> dict:
            if stream:
                return await streamed_turn(client, **call)
            choice = (out := await client.chat.completions.create(**call)).choices[0]
            return {"prompt": out.model_extra["prompt_token_ids"], "completion": choice.model_extra["token_ids"],
                    "text": choice.message.content, "finish": choice.finish_reason}

        def start(one=one):
            return asyncio.ensure_future(one())
        turn = await (await before_turn(k, start) if before_turn is not None else start())
        turns_out.append(turn)
        conversation.append({"role": "assistant", "content": turn["text"]})
    return turns_out


@pytest.mark.timeout(300)
async def test_a_gateway_session_is_token_exact_through_a_dead_worker_and_a_dead_gateway(settings, r, tmp_path):
    """Must-show 3 (gateway): 5 turns through ``redroll serve`` with the openai SDK; each turn's
    prompt ids as the engine ran them (the record's, in the response) are the previous turn's prompt
    + completion + the new messages' ids. The worker is SIGKILLed during turn 3 and the gateway
    replica killed and replaced before turn 4 (the session lives in Redis): with greedy decoding the
    turns equal those of an undisturbed session (two of whose turns are streamed), token for token;
    only the workers differ."""
    import os
    import signal

    import openai
    from transformers import AutoTokenizer

    from tests.conftest import spawn, stop_process, wait_until
    from tests.gateway_support import Served

    checkpoint = save_agent_checkpoint(tmp_path / "chatml", "hermes", seed=1)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    killed = spawn(settings, "worker", "--engine", "tests.agents_engines:StepDelayed", "--engine-arg",
                   f"model_path={checkpoint}", "--engine-arg", "step_ms=300", "--name", "w1",
                   log=tmp_path / "w1.log")
    survivor = Worker(settings, TransformersEngine(str(checkpoint)), max_inflight=4, block_ms=100, name="w2")
    replicas = [Served(settings, "--model-name", "chatml", "--request-timeout", "120", log=tmp_path / "a.log")]
    clients = [openai.AsyncOpenAI(base_url=replicas[0].v1, api_key="x", max_retries=0, timeout=120)]
    survivor_task = None

    async def chaos(k: int, start):
        nonlocal survivor_task
        if k == 2:  # turn 3: its request is in w1's hands when w1 is SIGKILLed
            task = start()

            async def held_by_w1() -> bool:
                return any(c["name"] in ("w1", b"w1") and c["pending"] for c in await r.xinfo_consumers(
                    settings.keys.requests, "workers"))
            await wait_until(held_by_w1, 60)
            os.kill(killed.pid, signal.SIGKILL)
            killed.wait()
            survivor_task = asyncio.create_task(survivor.run())
            return task
        if k == 3:  # turn 4: the gateway replica is gone; another serves the session
            replicas[0].kill()
            replicas.append(Served(settings, "--model-name", "chatml", "--request-timeout", "120",
                                   log=tmp_path / "b.log"))
            clients.append(openai.AsyncOpenAI(base_url=replicas[1].v1, api_key="x", max_retries=0, timeout=120))
        return start()

    class Current:  # (the client of the replica that serves now)
        def __getattr__(self, name):
            return getattr(clients[-1], name)
    try:
        disturbed = await gateway_session(Current(), "chaos", before_turn=chaos)
        reference = await gateway_session(clients[-1], "calm", streamed=(1, 3))  # (kept before [DONE] too)
    finally:
        survivor.request_stop()
        if survivor_task is not None:
            await asyncio.wait_for(survivor_task, 30)
        for c in clients:
            await c.close()
        for replica in replicas:
            replica.stop()
        if killed.poll() is None:
            stop_process(killed)
    assert disturbed == reference  # (prompt ids, completion ids, texts, finish reasons: token for token)
    for k, turn in enumerate(reference):
        if k == 0:
            assert turn["prompt"] == list(tokenizer.apply_chat_template(GATEWAY_TURNS[0], add_generation_prompt=True,
                                                                        return_dict=True)["input_ids"])
        else:
            before = reference[k - 1]["prompt"] + reference[k - 1]["completion"]
            assert turn["prompt"] == before + new_part(tokenizer, before, GATEWAY_TURNS[k]), k
    assert survivor.stats.published == 5 + 3  # (the calm session, and the disturbed one from turn 3 on)
    drifted = [t for t in reference[:-1]  # (a completion a later turn goes on from)
               if tokenizer.encode(tokenizer.decode(t["completion"]), add_special_tokens=False) != t["completion"]]
    assert drifted, "no completion re-encodes to other ids: the test proves nothing (change the seed)"
