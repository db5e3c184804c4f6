"""``redroll serve`` as RL clients drive vLLM's server, with their exact request bodies, against a
transformers worker process on the tiny checkpoint (one worker and one gateway for the module):
TRL's own ``VLLMClient`` (generate, chat), TRL's async GRPO rollout request, prime-rl's and SkyRL's
token-in/token-out calls (``/inference/v1/generate``), prime-rl's eval chat (its literal
``extra_body``, refused by name), ``prompt_logprobs``, a request's own chat template, and the
context length on ``/v1/models``. Each answer is checked against the same request through the
Python API.

Where each body comes from (pinned versions; prime-rl and SkyRL are not on the registry, so they
were read from their repositories at the commits named):

* TRL 1.16.0: ``trl/generation/vllm_client.py`` (see tests/trl_checks.py);
  ``trl/experimental/async_grpo/async_rollout_worker.py:1000-1017`` (the rollout body) and
  ``:1023-1024`` (it reads ``choices[0].token_ids`` and ``logprobs.token_logprobs``);
  ``trl/experimental/async_grpo/vllm_client.py:88-92`` (``data[0].max_model_len``).
* prime-rl @559b44772e471d1538537b8805cc77f3824a5e64 with verifiers @a60a606e and renderers
  @010c894c: the train call ``POST /inference/v1/generate`` built in
  ``verifiers/v1/clients/train.py:358-363`` and renderers' ``generate()`` (``logprobs: 1``,
  ``stop_token_ids``, ``skip_special_tokens: false``, ``cache_salt`` in ``sampling_params``); the
  prefill score, ``src/prime_rl/utils/client.py:491-500``; the eval chat with ``extra_body`` as a
  literal key, ``verifiers/v1/dialects/chat.py:547-556``.
* SkyRL @a9564572eb8e91076be43c1bd5e4615e3de17265,
  ``skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py`` (RIC): generate
  RIC:491-501 with the default sampling params of ``inference_servers/engine_utils.py:55-82``;
  sample RIC:662-678.
"""

from __future__ import annotations

import uuid

import httpx
import pytest
import pytest_asyncio

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from redroll.engine_worker.engines.tiny_checkpoint import (  # noqa: E402
    MAX_POSITIONS,
    TINY_CHAT_TEMPLATE,
    save_tiny_checkpoint,
)
from redroll.producer.client import Producer  # noqa: E402
from redroll.shared.settings import Settings  # noqa: E402
from tests.conftest import spawn, stop_process  # noqa: E402
from tests.gateway_support import Served  # noqa: E402
from tests.trl_checks import check_chat, check_generate, vllm_client  # noqa: E402

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny"
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-rl"), 0, chat_template=TINY_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoint))


@pytest.fixture(scope="module")
def settings(redis_server):
    return Settings(redis_url=redis_server.url, namespace="rl" + uuid.uuid4().hex[:10])


@pytest.fixture(scope="module")
def gateway(settings, checkpoint, tmp_path_factory):
    """One transformers worker process and one gateway (a client's own model name, such as TRL's
    async GRPO's checkpoint path, goes to the one model; chat templates from calls are taken)."""
    logs = tmp_path_factory.mktemp("gw-rl")
    worker = spawn(settings, "worker", "--engine", "transformers", "--model-path", str(checkpoint),
                   "--max-inflight", "16", "--name", "rl-tf", log=logs / "worker.log")
    served = None
    try:
        served = Served(settings, "--model-name", MODEL, "--default-model", MODEL, "--trust-request-chat-template",
                        "--request-timeout", "300", log=logs / "serve.log")
        yield served
    finally:
        if served is not None:
            served.stop()
        stop_process(worker, 60)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def producer(settings, gateway):
    async with Producer(settings, block_ms=200) as p:
        yield p


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def http(gateway):
    async with httpx.AsyncClient(base_url=gateway.url, timeout=300) as client:
        yield client


async def test_trls_vllm_client_generate_and_chat_equal_the_python_api(gateway, producer, tokenizer):
    """Must-show: TRL's VLLMClient.generate and .chat (trl 1.16.0, the main environment: no vLLM,
    only its constructor's vLLM check patched) get the prompt ids, completion ids and logprobs
    that the same requests get through the Python API."""
    client = vllm_client(gateway.url)
    assert client.model == MODEL
    await check_generate(client, producer, [tokenizer("The quick brown fox")["input_ids"], [5, 6, 7, 8]])
    await check_chat(client, producer)


async def test_trls_async_grpo_rollout_request(http, producer):
    """The exact rollout body of TRL's async GRPO (its model id is the checkpoint path: the default
    model takes it), and the context length it reads from /v1/models."""
    cards = (await http.get("/v1/models")).json()["data"]
    assert cards[0]["id"] == MODEL and cards[0]["max_model_len"] == MAX_POSITIONS
    body = {"model": "/work/scratch/trl/tiny-llama", "prompt": [4, 37, 45, 53, 1, 5], "max_tokens": 12,
            "temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0, "n": 1, "return_token_ids": True,
            "logprobs": 0, "seed": 5723331781914093496}
    out = (await http.post("/v1/completions", json=body)).json()
    choice = out["choices"][0]
    rec = await producer.generate(input_ids=body["prompt"], return_logprob=True, timeout=300, sampling_params={
        "max_new_tokens": 12, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "sampling_seed": 5723331781914093496})
    assert choice["token_ids"] == rec.output_token_ids[0]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(rec.output_logprobs[0], abs=1e-4)
    assert choice["logprobs"]["top_logprobs"] == [{f"token_id:{t}": pytest.approx(lp, abs=1e-4)}
                                                   for t, lp in zip(rec.output_token_ids[0], rec.output_logprobs[0])]


async def test_prime_rl_and_skyrl_generate_calls(http, producer, tokenizer):
    """vLLM's /inference/v1/generate with prime-rl's train body and SkyRL's generate and sample
    bodies: the ids and logprobs of the same requests through the Python API; prime-rl's prefill
    score asks prompt_logprobs 1, refused by name (0 is honoured)."""
    prompt = tokenizer("A queue of requests waits")["input_ids"]
    eos = tokenizer.eos_token_id
    want = await producer.generate(input_ids=prompt, return_logprob=True, timeout=300,
                                   sampling_params={"max_new_tokens": 8, **GREEDY, "stop_token_ids": [eos]})
    prime = {"model": MODEL, "token_ids": prompt,
             "sampling_params": {"cache_salt": "3", "temperature": 0.0, "top_p": 1.0, "logprobs": 1, "max_tokens": 8,
                                 "stop_token_ids": [eos], "skip_special_tokens": False, "ignore_eos": True,
                                 "routed_experts_prompt_start": 0}}
    out = (await http.post("/inference/v1/generate", json=prime, headers={"X-Session-ID": "s-1"})).json()
    choice = out["choices"][0]
    assert out["request_id"] and choice["token_ids"] == want.output_token_ids[0]
    assert [c["logprob"] for c in choice["logprobs"]["content"]] == pytest.approx(want.output_logprobs[0], abs=1e-4)
    assert choice["finish_reason"] == want.finish_reasons[0] and out["usage"]["prompt_tokens"] == len(prompt)
    assert choice["weight_versions"] == [{"version": want.meta_info["weight_version"], "start": 0, "end": 8}]

    skyrl = {"sampling_params": {"min_tokens": 1, "skip_special_tokens": True, "include_stop_str_in_output": True,
                                 "max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                                 "logprobs": 1, "stop": None, "ignore_eos": True},
             "model": MODEL, "token_ids": prompt, "cache_salt": f"{MODEL}@0", "request_id": "skyrl-1"}
    out = (await http.post("/inference/v1/generate", json=skyrl)).json()
    assert out["request_id"] == "skyrl-1" and out["choices"][0]["token_ids"] == want.output_token_ids[0]

    sample = {"sampling_params": {"n": 2, "logprobs": 0, "output_kind": 2, "prompt_logprobs": None, "temperature": 1.0,
                                  "max_tokens": 6, "seed": 3, "top_k": -1, "top_p": 1.0, "stop": None,
                                  "stop_token_ids": None},
              "model": MODEL, "token_ids": prompt}
    out = (await http.post("/inference/v1/generate", json=sample)).json()
    seeded = await producer.generate(input_ids=prompt, return_logprob=True, timeout=300, sampling_params={
        "n": 2, "max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 3})
    assert [c["token_ids"] for c in out["choices"]] == seeded.output_token_ids

    score = {"model": MODEL, "token_ids": prompt,
             "sampling_params": {"max_tokens": 1, "temperature": 1.0, "top_p": 1.0, "prompt_logprobs": 1}}
    refused = await http.post("/inference/v1/generate", json=score)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "sampling_params.prompt_logprobs"
    score["sampling_params"]["prompt_logprobs"] = 0
    scored = (await http.post("/inference/v1/generate", json=score)).json()
    truth = await producer.generate(input_ids=prompt, return_logprob=True, logprob_start_len=0, timeout=300,
                                    sampling_params={"max_new_tokens": 1, "temperature": 1.0})
    assert scored["prompt_logprobs"][0] is None
    assert [next(iter(d.values()))["logprob"] for d in scored["prompt_logprobs"][1:]] == pytest.approx(
        truth.input_logprobs[1:], abs=1e-4)
    assert [int(next(iter(d))) for d in scored["prompt_logprobs"][1:]] == prompt[1:]

    for body, param in (({**prime, "features": {"mm_hashes": {}}}, "features"),
                        ({**prime, "stream": True}, "stream"),
                        ({**prime, "sampling_params": {**prime["sampling_params"], "top_a": 1}}, "sampling_params.top_a")):
        out = await http.post("/inference/v1/generate", json=body)
        assert out.status_code == 400 and out.json()["error"]["param"] == param, out.text


async def test_prompt_logprobs_a_requests_chat_template_and_refusals(http, producer, tokenizer):
    """prompt_logprobs 0 on a text prompt: each prompt token's own logprob, keyed by the ids the
    worker ran; a chat with its own template (the gateway trusts them here) renders with it;
    prime-rl's eval body with extra_body as a literal key is refused naming it."""
    out = (await http.post("/v1/completions", json={"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 1,
                                                    "prompt_logprobs": 0, "return_token_ids": True})).json()
    choice = out["choices"][0]
    ids = tokenizer("The quick brown fox")["input_ids"]
    truth = await producer.generate(input_ids=ids, return_logprob=True, logprob_start_len=0, timeout=300,
                                    sampling_params={"max_new_tokens": 1})
    assert choice["prompt_token_ids"] == ids and choice["logprobs"] is None
    assert choice["prompt_logprobs"][0] is None and [list(d) for d in choice["prompt_logprobs"][1:]] == [
        [str(t)] for t in ids[1:]]
    assert [d[str(t)]["logprob"] for d, t in zip(choice["prompt_logprobs"][1:], ids[1:])] == pytest.approx(
        truth.input_logprobs[1:], abs=1e-4)

    own = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if shout %}!{% endif %}>"
    messages = [{"role": "user", "content": "a queue of requests"}]
    chat = (await http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "max_tokens": 4, "chat_template": own,
        "chat_template_kwargs": {"shout": True}, "return_token_ids": True, "logprobs": True, "top_logprobs": 0})).json()
    rendered = tokenizer.apply_chat_template(messages, chat_template=own, shout=True, add_generation_prompt=True,
                                             tokenize=True)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert chat["prompt_token_ids"] == rendered
    assert [e["top_logprobs"] for e in chat["choices"][0]["logprobs"]["content"]] == [[]] * 4

    eval_body = {"messages": messages, "temperature": 0.6, "top_p": 0.95, "max_tokens": 8,
                 "extra_body": {"top_k": 20, "min_p": 0.0, "cache_salt": "7"}, "model": MODEL}
    refused = await http.post("/v1/chat/completions", json=eval_body)
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "extra_body" and "top level" in error["message"]
    flat = {**{k: v for k, v in eval_body.items() if k != "extra_body"}, **eval_body["extra_body"]}
    assert (await http.post("/v1/chat/completions", json=flat)).status_code == 200
