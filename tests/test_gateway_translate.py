"""The gateway's translation, in process (no server): OpenAI bodies to requests, and the rules the
docs state (the priority mapping, session keys, field names in errors, token-id prompts), and the
stream chunks written from redroll's (a streamed call's fan-out, top logprobs, usage)."""

from __future__ import annotations

import msgspec
import pytest

pytest.importorskip("starlette")

from redroll.shared.settings import Settings  # noqa: E402
from redroll.shared.types import ChatMessage  # noqa: E402
from redroll.web.gateway.idempotency import call_name  # noqa: E402
from redroll.web.gateway.protocol import ChatBody, CompletionBody, GatewayError, decode_body  # noqa: E402
from redroll.web.gateway.translate import build_requests, redroll_priority, session_key  # noqa: E402

SETTINGS = Settings(namespace="t")


def requests_of(raw: bytes, kind=CompletionBody, session: str | None = None):
    return build_requests(decode_body(raw, kind), base_id="g-1", session=session, settings=SETTINGS, fingerprint="f")


def test_vllm_priority_lower_is_earlier_below_zero_is_high():
    assert [redroll_priority(p) for p in (-10, -1, 0, 1, 5)] == [1, 1, 0, 0, 0]
    (req,) = requests_of(b'{"prompt": "x", "priority": -1}')
    assert req.priority == 1


def test_a_completion_body_becomes_requests():
    (req,) = requests_of(b'{"prompt": "hi", "n": 4, "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, '
                         b'"seed": 3, "stop": "\\n", "logprobs": 0, "min_weight_version": 2}')
    sp = req.sampling_params
    assert (sp.n, sp.max_new_tokens, sp.temperature, sp.top_p, sp.sampling_seed, sp.stop) == (4, 7, 0.5, 0.9, 3, ("\n",))
    assert req.return_logprob and req.top_logprobs_num == 0 and req.return_text and req.min_weight_version == 2
    ids, text = requests_of(b'{"prompt": [[1, 2], "two"]}')
    assert ids.input_ids == [1, 2] and text.prompt == "two"
    assert ids.group_id == text.group_id == "g-1" and [ids.request_id, text.request_id] == ["g-1-0", "g-1-1"]


def test_a_chat_body_becomes_a_chat_request():
    (req,) = requests_of(b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5, '
                         b'"logprobs": true, "top_logprobs": 2}', ChatBody, session="alice")
    assert req.messages == [ChatMessage(role="user", content="hi")] and req.sampling_params.max_new_tokens == 5
    assert req.top_logprobs_num == 2 and req.affinity_key == session_key("alice")


@pytest.mark.parametrize("raw, kind, param", [
    (b'{"prompt": "x", "max_tokens": -1}', CompletionBody, "max_tokens"),
    (b'{"prompt": "x", "n": 65}', CompletionBody, "n"),
    (b'{"prompt": "x", "top_k": -2}', CompletionBody, "top_k"),
    (b'{"prompt": "x", "no_such_field": 1}', CompletionBody, "no_such_field"),
    (b'{"prompt": "x", "extra_body": {"top_k": 20}}', CompletionBody, "extra_body"),
    (b'{"prompt": "x", "stream": true, "stream_options": {"include_usage": true, "x": 1}}', CompletionBody,
     "stream_options.x"),
    (b'{"prompt": "x", "structured_outputs": {"choice": ["a"]}}', CompletionBody, "structured_outputs.choice"),
    (b'{"prompt": "x", "prompt_logprobs": 1}', CompletionBody, "prompt_logprobs"),
    (b'{"prompt": "x", "prompt_logprobs": 0, "stream": true}', CompletionBody, "prompt_logprobs"),
    (b'{"prompt": "x", "return_tokens_as_token_ids": false}', CompletionBody, "return_tokens_as_token_ids"),
    (b'{"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ x }}"}', ChatBody, "chat_template"),
    (b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": false}}', ChatBody,
     "chat_template_kwargs.tokenize"),
    (b'{"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "huge"}', ChatBody, "reasoning_effort"),
    (b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}', ChatBody, "tool_choice"),
    (b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}], '
     b'"tool_choice": "sometimes"}', ChatBody, "tool_choice"),
    (b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "grammar"}}', ChatBody,
     "response_format"),
    (b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": '
     b'{"name": "a", "schema": {}, "x": 1}}}', ChatBody, "response_format.json_schema.x"),
    (b'{"prompt": "x", "stream_options": {"include_usage": true}}', CompletionBody, "stream_options"),
    (b'{"prompt": "x", "stream": true, "seed": 9223372036854775807, "n": 2}', CompletionBody, "seed"),
    (b'{"prompt": []}', CompletionBody, "prompt"),
    (b'{"n": 1}', CompletionBody, "prompt"),
    (b'not json', CompletionBody, None),
    (b'{"messages": [{"role": "user", "content": "x", "image": 1}]}', ChatBody, "messages[0].image"),
    (b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', ChatBody, "top_logprobs"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 99999999}', ChatBody,
     "max_completion_tokens"),
])
def test_errors_name_the_openai_field(raw, kind, param):
    from redroll.web.gateway.protocol import refuse_unsupported

    with pytest.raises(GatewayError) as err:
        body = decode_body(raw, kind)
        refuse_unsupported(body)
        build_requests(body, base_id="g-1", session=None, settings=SETTINGS, fingerprint="f")
    assert err.value.status == 400 and err.value.param == param
    if param:
        assert param in err.value.message and "\n" not in err.value.message


def test_session_keys_and_call_names_are_stable_and_request_id_shaped():
    assert session_key("a user name with spaces") == session_key("a user name with spaces")
    assert session_key(None) is None and session_key("a") != session_key("b")
    assert call_name("k", "") == call_name("k", "") != call_name("k", "other caller")
    assert call_name("k", "").startswith("i-") and len(call_name("k", "")) <= 64


def test_a_streamed_call_is_one_request_per_choice():
    """n choices of each prompt, each one sample (a streamed request makes one), seeded seed + i."""
    reqs = requests_of(b'{"prompt": ["a", [1, 2]], "n": 3, "seed": 10, "stream": true, "max_tokens": 4}')
    assert [r.request_id for r in reqs] == [f"g-1-{i}" for i in range(6)]
    assert [r.prompt or r.input_ids for r in reqs] == ["a"] * 3 + [[1, 2]] * 3
    assert [r.sampling_params.sampling_seed for r in reqs] == list(range(10, 16))
    assert {(r.sampling_params.n, r.stream, r.group_id, r.sampling_params.max_new_tokens) for r in reqs} == {
        (1, True, "g-1", 4)}
    unseeded = requests_of(b'{"messages": [{"role": "user", "content": "hi"}], "n": 2, "stream": true}', ChatBody)
    assert [r.sampling_params.sampling_seed for r in unseeded] == [None, None]
    (one,) = requests_of(b'{"prompt": "a", "stream": true}')
    assert one.group_id is None and one.stream
    (plain,) = requests_of(b'{"prompt": "a", "n": 3}')  # (not streamed: one request of n samples)
    assert plain.sampling_params.n == 3 and not plain.stream


def test_stream_chunks_in_openai_shape():
    """A chat's role chunk first; logprobs and top logprobs per token (a chunk's own, else the
    record's for the last chunk); the usage chunk counts each prompt once."""
    from redroll.producer.stream_reader import StreamChunk
    from redroll.shared.types import CompletionRecord, RecordStatus
    from redroll.web.gateway.sse import EventWriter

    body = decode_body(b'{"messages": [{"role": "user", "content": "hi"}], "n": 2, "stream": true, "logprobs": true, '
                       b'"top_logprobs": 1, "stream_options": {"include_usage": true}}', ChatBody)
    writer = EventWriter(body, "c", "redroll", 5, [None])
    events = [msgspec.json.decode(e[len(b"data: "):]) for e in writer.opening().split(b"\n\n") if e]
    assert [e["choices"][0]["delta"] for e in events] == [{"role": "assistant", "content": ""}] * 2
    assert {e["object"] for e in events} == {"chat.completion.chunk"} and all(e["usage"] is None for e in events)
    first = msgspec.json.decode(writer.chunk(1, StreamChunk(request_id="r-1", offset=0, token_ids=[3, 4], text=" a b",
                                                            logprobs=[-0.5, -0.25],
                                                            top_logprobs=[[(3, -0.5)], [(4, -0.25)]]))[len(b"data: "):])
    (choice,) = first["choices"]
    assert choice["index"] == 1 and choice["delta"] == {"content": " a b"} and choice["finish_reason"] is None
    assert [(e["token"], e["logprob"], e["top_logprobs"]) for e in choice["logprobs"]["content"]] == [
        ("token_id:3", -0.5, [{"token": "token_id:3", "logprob": -0.5, "bytes": list(b"token_id:3")}]),
        ("token_id:4", -0.25, [{"token": "token_id:4", "logprob": -0.25, "bytes": list(b"token_id:4")}])]
    record = CompletionRecord(request_id="r-1", status=RecordStatus.FINISHED, output_token_ids=[[3, 4, 5]],
                              finish_reasons=["length"], output_logprobs=[[-0.5, -0.25, -1.0]],
                              output_top_logprobs=[[[(3, -0.5)], [(4, -0.25)], [(7, -0.1)]]], output_text=[" a b c"],
                              meta_info={"prompt_tokens": 6, "weight_version": "2"})
    last = msgspec.json.decode(writer.chunk(1, StreamChunk(request_id="r-1", offset=2, token_ids=[5], text=" c",
                                                           logprobs=[-1.0], finish_reason="length",
                                                           record=record))[len(b"data: "):])
    (choice,) = last["choices"]
    assert choice["finish_reason"] == "length" and choice["weight_version"] == "2"
    # (as vLLM's: a position's candidates are the sampled token first, then the most likely; a chat's
    # top_logprobs: k are the first k of them)
    assert choice["logprobs"]["content"] == [{"token": "token_id:5", "logprob": -1.0, "bytes": None,
                                              "top_logprobs": [{"token": "token_id:5", "logprob": -1.0,
                                                                "bytes": list(b"token_id:5")}]}]
    writer.records[0] = record
    assert writer.usage() == {"prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12}
    failed = CompletionRecord.failed(None, request_id="r-0", status=RecordStatus.ERROR, error="invalid messages: no",
                                     worker="w")
    with pytest.raises(GatewayError) as refused:
        writer.chunk(0, StreamChunk(request_id="r-0", offset=0, token_ids=[], text=None, logprobs=None, record=failed))
    assert refused.value.status == 400 and refused.value.param == "messages"


def test_vllms_rl_extensions_become_requests():
    """top_k 0 is off (redroll's -1), min_p and repetition_penalty pass through, logprobs 0 asks for
    the sampled token's logprob only, return_token_ids on a text or chat prompt asks the worker for
    the ids it ran, prompt_logprobs 0 for the prompt's logprobs, structured outputs become SGLang's
    keys, a chat's template and its variables go with it."""
    (text,) = requests_of(b'{"prompt": "hi", "top_k": 0, "min_p": 0.1, "repetition_penalty": 1.2, "logprobs": 0, '
                          b'"return_token_ids": true, "return_tokens_as_token_ids": true, "cache_salt": "7"}')
    sp = text.sampling_params
    assert (sp.top_k, sp.min_p, sp.repetition_penalty) == (-1, 0.1, 1.2)
    assert text.return_logprob and text.top_logprobs_num == 0 and text.return_prompt_token_ids
    (ids,) = requests_of(b'{"prompt": [1, 2], "top_k": -1, "return_token_ids": true, "prompt_logprobs": 0}')
    assert ids.sampling_params.top_k == -1 and not ids.return_prompt_token_ids  # (the gateway echoes sent ids)
    assert ids.logprob_start_len == 0 and ids.return_logprob and ids.meta_info["gateway"]["lp"] is False
    (regex,) = requests_of(b'{"prompt": "x", "structured_outputs": {"regex": "a+", "json": {"type": "object"}}}')
    assert regex.sampling_params.regex == "a+" and regex.sampling_params.json_schema == '{"type":"object"}'
    body = decode_body(b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 0, '
                       b'"chat_template": "{{ messages }}", "chat_template_kwargs": {"enable_thinking": false}, '
                       b'"return_token_ids": true}', ChatBody)
    from redroll.web.gateway.protocol import refuse_unsupported

    refuse_unsupported(body, trust_chat_template=True)
    (chat,) = build_requests(body, base_id="g-1", session=None, settings=SETTINGS, fingerprint="f")
    assert chat.chat_template == "{{ messages }}" and chat.chat_template_kwargs == {"enable_thinking": False}
    assert chat.return_prompt_token_ids and chat.return_logprob and chat.top_logprobs_num == 0 and chat.v == 4
    (effort,) = requests_of(b'{"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "none"}', ChatBody)
    assert effort.chat_template_kwargs == {"reasoning_effort": "none", "enable_thinking": False}  # (as vLLM passes it)


def test_logprobs_in_vllms_shapes():
    """Completions' logprobs k: the first k + 1 candidates (the sampled token first), 0 the sampled
    token alone; chats' top_logprobs k: the first k (0: none); -inf as -9999.0."""
    from redroll.web.gateway.logprobs import chat_logprobs, completion_logprobs, generate_logprobs, prompt_logprobs

    ids, lps, tops = [5, 6], [-0.5, float("-inf")], [[(9, -0.1), (5, -0.5)], [(9, -0.2), (8, -0.3)]]
    zero = completion_logprobs(ids, lps, None, 0)
    assert zero == {"text_offset": [], "token_logprobs": [-0.5, -9999.0], "tokens": ["token_id:5", "token_id:6"],
                    "top_logprobs": [{"token_id:5": -0.5}, {"token_id:6": -9999.0}]}
    two = completion_logprobs(ids, lps, tops, 2)["top_logprobs"]
    assert two == [{"token_id:5": -0.5, "token_id:9": -0.1}, {"token_id:6": -9999.0, "token_id:9": -0.2,
                                                               "token_id:8": -0.3}]
    assert [list(d) for d in two][0] == ["token_id:5", "token_id:9"]  # (the sampled token first)
    assert [e["top_logprobs"] for e in chat_logprobs(ids, lps, None, 0)["content"]] == [[], []]
    assert [[t["token"] for t in e["top_logprobs"]] for e in chat_logprobs(ids, lps, tops, 2)["content"]] == [
        ["token_id:5", "token_id:9"], ["token_id:6", "token_id:9"]]
    gen = generate_logprobs(ids, lps, tops, 0)["content"]
    assert gen[0] == {"token_id": 5, "logprob": -0.5, "rank": None,
                      "top_logprobs": [{"token_id": 5, "logprob": -0.5, "rank": None}]}
    assert prompt_logprobs([4, 7], [None, -1.5]) == [None, {"7": {"logprob": -1.5, "rank": None,
                                                                 "decoded_token": None}}]


def test_a_streamed_text_prompts_ids_come_with_its_record():
    """return_token_ids on a streamed text prompt: the ids the worker ran come on the choice's
    last chunk (a token-id prompt's on its first); a chat's at the top level of choice 0's last."""
    from redroll.producer.stream_reader import StreamChunk
    from redroll.shared.types import CompletionRecord, RecordStatus
    from redroll.web.gateway.sse import EventWriter

    def record(prompt_ids):
        return CompletionRecord(request_id="r-0", status=RecordStatus.FINISHED, output_token_ids=[[3]],
                                finish_reasons=["length"], output_text=[" a"], prompt_token_ids=prompt_ids,
                                meta_info={"prompt_tokens": 2, "weight_version": "1"})

    def chunk(writer, rec=None, index=0):
        data = writer.chunk(index, StreamChunk(request_id="r-0", offset=0, token_ids=[3], text=" a", logprobs=None,
                                               finish_reason="length" if rec else None, record=rec))
        return msgspec.json.decode(data[len(b"data: "):])

    body = decode_body(b'{"prompt": ["hi", [7, 8]], "stream": true, "return_token_ids": true}', CompletionBody)
    writer = EventWriter(body, "c", "m", 5, [None, [7, 8]])
    assert "prompt_token_ids" not in chunk(writer)["choices"][0]  # (a text: not known yet)
    assert chunk(writer, record([104, 105]))["choices"][0]["prompt_token_ids"] == [104, 105]
    assert chunk(writer, index=1)["choices"][0]["prompt_token_ids"] == [7, 8]
    chat = decode_body(b'{"messages": [{"role": "user", "content": "hi"}], "stream": true, "return_token_ids": true}',
                       ChatBody)
    writer = EventWriter(chat, "c", "m", 5, [None])
    assert chunk(writer, record([4, 5, 6]))["prompt_token_ids"] == [4, 5, 6]
