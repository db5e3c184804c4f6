"""Tool calls through the door, with the official ``openai`` SDK, streamed and not, on real worker
processes: each parser family (``hermes``, ``llama3_json``) on a scripted synthetic worker
(``--script``) and on a transformers worker whose tiny checkpoint learned to say the call
(tests/agents_support.py); the tool's result sent back and the final answer; ``tool_choice``
``none``, ``auto``, ``required`` and a named function (honoured with the transformers engine's
grammar, refused by the synthetic engine); the same calls through the Python API's records.
One gateway serves the four workers as four models."""

from __future__ import annotations

import json
import uuid

import pytest
import pytest_asyncio

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")

from redroll.producer.client import Producer  # noqa: E402
from redroll.shared.settings import Settings  # noqa: E402
from tests.agents_support import (  # noqa: E402
    ANSWER,
    ARGUMENTS,
    QUESTION,
    TOOLS,
    after_call,
    script_file,
    scripted_checkpoint,
    streamed_message,
)
from tests.conftest import spawn, stop_process  # noqa: E402
from tests.gateway_support import Served  # noqa: E402

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

FAMILIES = ("hermes", "llama3_json")
MODELS = [f"{engine}-{family}" for engine in ("synthetic", "transformers") for family in FAMILIES]
GREEDY = {"temperature": 0.0, "max_tokens": 80}


@pytest.fixture(scope="module")
def namespaces():
    base = "ag" + uuid.uuid4().hex[:8]
    return {model: f"{base}{i}" for i, model in enumerate(MODELS)}


@pytest.fixture(scope="module")
def gateway(redis_server, namespaces, tmp_path_factory):
    """Four workers (one per engine and family), one gateway serving them as four models."""
    logs = tmp_path_factory.mktemp("agents")
    procs = []
    try:
        for model, ns in namespaces.items():
            engine, family = model.split("-", 1)
            settings = Settings(redis_url=redis_server.url, namespace=ns)
            source = (["--script", str(script_file(logs, family))] if engine == "synthetic"
                      else ["--model-path", str(scripted_checkpoint(logs, family))])
            procs.append(spawn(settings, "worker", "--engine", engine, *source, "--tool-call-parser", family,
                               "--name", model, log=logs / f"{model}.log"))
        models = ",".join(f"{m}={ns}" for m, ns in namespaces.items())
        served = Served(Settings(redis_url=redis_server.url, namespace=next(iter(namespaces.values()))),
                        "--request-timeout", "120", log=logs / "serve.log", REDROLL_MODELS=models)
        yield served
        served.stop()
    finally:
        for proc in procs:
            stop_process(proc, 30)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(gateway):
    async with openai.AsyncOpenAI(base_url=gateway.v1, api_key="none", timeout=120, max_retries=0) as c:
        yield c


@pytest.mark.parametrize("model", MODELS)
async def test_a_tool_call_its_result_and_the_answer(client, model):
    """Must-show 1: the model's call parsed into tool_calls (id, name, JSON arguments) with
    finish_reason tool_calls, streamed and not; the tool's result sent back gets the answer."""
    out = await client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, **GREEDY)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == ARGUMENTS and not choice.message.content
    content, calls, finish = await streamed_message(client, model=model, messages=QUESTION, tools=TOOLS, **GREEDY)
    assert finish == "tool_calls" and not content.strip()
    assert [(c["name"], c["arguments"]) for c in calls] == [("add", call.function.arguments)]
    assert calls[0]["id"].startswith("call_")  # (another call: another id)

    conversation = QUESTION + [choice.message.model_dump(exclude_none=True),
                               {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    final = await client.chat.completions.create(model=model, messages=conversation, tools=TOOLS, **GREEDY)
    assert final.choices[0].message.content == ANSWER and final.choices[0].finish_reason == "stop"
    assert not final.choices[0].message.tool_calls
    content, calls, finish = await streamed_message(client, model=model, messages=conversation, tools=TOOLS, **GREEDY)
    assert (content, calls, finish) == (ANSWER, [], "stop")


@pytest.mark.parametrize("model", MODELS)
async def test_tool_choice_none_leaves_the_call_as_text(client, model):
    out = await client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, tool_choice="none",
                                               **GREEDY)
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert json.dumps(ARGUMENTS)[1:-1].split(",")[0] in choice.message.content  # ('"a": 2' is there, as text)


@pytest.mark.parametrize("family", FAMILIES)
async def test_required_and_named_choices_constrain_the_transformers_engine(client, family):
    """A required or named choice makes the grammar write calls that validate against the tool's
    schema (the tiny model alone would write its scripted text); finish_reason tool_calls for
    required, stop for named (vLLM's rule)."""
    import jsonschema

    model = f"transformers-{family}"
    for choice, reason in (("required", "tool_calls"), ({"type": "function", "function": {"name": "add"}}, "stop")):
        for stream in (False, True):
            kw = dict(model=model, messages=QUESTION, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=3,
                      parallel_tool_calls=False, max_tokens=120)
            if stream:
                _, calls, finish = await streamed_message(client, **kw)
            else:
                out = (await client.chat.completions.create(**kw)).choices[0]
                assert out.message.tool_calls, out
                calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                         for c in out.message.tool_calls]
                finish = out.finish_reason
            assert finish == reason and calls, (choice, stream)
            for call in calls:
                assert call["name"] == "add"
                jsonschema.validate(json.loads(call["arguments"]), TOOLS[0]["function"]["parameters"])


@pytest.mark.parametrize("family", FAMILIES)
async def test_the_synthetic_engine_refuses_what_needs_a_grammar(client, family):
    for kw in ({"tool_choice": "required"}, {"tool_choice": {"type": "function", "function": {"name": "add"}}},
               {"response_format": {"type": "json_object"}}):
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model=f"synthetic-{family}", messages=QUESTION, tools=TOOLS,
                                                 **GREEDY, **kw)
        param = "tool_choice" if "tool_choice" in kw else "response_format"
        assert err.value.body["param"] == param and "synthetic engine" in err.value.body["message"], err.value.body


async def test_the_python_api_returns_the_same_calls(client, redis_server, namespaces):
    """The record carries the parsed calls: the same as the gateway's answer (ids included: they
    derive from the request_id, which the gateway names; here the record's own)."""
    for model in MODELS:
        out = await client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, **GREEDY)
        async with Producer(Settings(redis_url=redis_server.url, namespace=namespaces[model])) as producer:
            rec = await producer.generate(messages=QUESTION, tools=TOOLS, tool_choice="auto", timeout=120,
                                          sampling_params={"temperature": 0.0, "max_new_tokens": 80})
        (calls,) = rec.tool_calls
        assert [(c.name, c.arguments) for c in calls.calls] == [
            (c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls]
        assert calls.calls[0].id.startswith("call_") and rec.finish_reasons == ["stop"]
        follow = await client.chat.completions.create(model=model, messages=after_call(calls.calls[0].id),
                                                      tools=TOOLS, **GREEDY)
        assert follow.choices[0].message.content == ANSWER
