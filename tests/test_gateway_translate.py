"""The gateway's translation, in process (no server): OpenAI bodies to requests, and the rules the
docs state (the priority mapping, session keys, field names in errors, token-id prompts)."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")

from redroll.gateway.idempotency import call_name  # noqa: E402
from redroll.gateway.protocol import ChatBody, CompletionBody, GatewayError, decode_body  # noqa: E402
from redroll.gateway.translate import build_requests, redroll_priority, session_key  # noqa: E402
from redroll.shared.settings import Settings  # noqa: E402
from redroll.shared.types import ChatMessage  # noqa: E402

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
    (b'{"prompt": "x", "top_k": 0}', CompletionBody, "top_k"),
    (b'{"prompt": []}', CompletionBody, "prompt"),
    (b'{"n": 1}', CompletionBody, "prompt"),
    (b'not json', CompletionBody, None),
    (b'{"messages": [{"role": "user", "content": "x", "image": 1}]}', ChatBody, "messages[0].image"),
    (b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', ChatBody, "top_logprobs"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 99999999}', ChatBody,
     "max_completion_tokens"),
])
def test_errors_name_the_openai_field(raw, kind, param):
    from redroll.gateway.protocol import refuse_unsupported

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
