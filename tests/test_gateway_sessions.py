"""The gateway's session state (redroll/web/gateway/sessions.py) on a real Redis: which calls
continue a session (their messages begin with exactly the ones it covers, the reply as returned),
which start it over, and that callers with other API keys never share one."""

from __future__ import annotations

from redroll.shared.types import CompletionRecord, RecordStatus
from redroll.web.gateway.sessions import Sessions

FIRST = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
REPLY = {"role": "assistant", "content": "Hello."}


def record(prompt: list[int], completion: list[int]) -> CompletionRecord:
    return CompletionRecord(request_id="x", status=RecordStatus.FINISHED, output_token_ids=[completion],
                            finish_reasons=["stop"], prompt_token_ids=prompt)


async def test_a_call_that_extends_the_session_continues_it_and_any_other_starts_it_over(settings, r):
    sessions = Sessions(r, settings.keys, window_s=60)
    first = await sessions.begin("", "s", FIRST)
    assert first.prefix_ids is None and first.new_messages == FIRST
    await sessions.keep(first, record([1, 2, 3], [4, 5]), REPLY)
    assert 0 < await r.ttl(sessions.key("", "s")) <= 60
    new = [{"role": "user", "content": "More"}]
    # the SDK's echo of the reply (content null vs absent, extra null fields) is the same reply
    turn = await sessions.begin("", "s", [*FIRST, {**REPLY, "tool_calls": None, "name": None}, *new])
    assert turn.prefix_ids == [1, 2, 3, 4, 5] and turn.new_messages == new
    await sessions.keep(turn, record([1, 2, 3, 4, 5, 6], [7]), {"role": "assistant", "content": None,
                                                               "tool_calls": [{"id": "call_1", "type": "function",
                                                                               "function": {"name": "f",
                                                                                            "arguments": "{}"}}]})
    calls = {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                  "function": {"name": "f", "arguments": "{}"}}]}
    tool = [{"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    third = await sessions.begin("", "s", [*FIRST, REPLY, *new, calls, *tool])
    assert third.prefix_ids == [1, 2, 3, 4, 5, 6, 7] and third.new_messages == tool and third.turns == 2
    # an edited history, another reply, nothing new, another caller's key: rendered whole
    for scope, messages in (("", [FIRST[1], REPLY, *new]), ("", [*FIRST, {**REPLY, "content": "Hey."}, *new]),
                            ("", [*FIRST, REPLY]), ("other-key", [*FIRST, REPLY, *new])):
        turn = await sessions.begin(scope, "s", messages)
        assert turn.prefix_ids is None and turn.new_messages == messages and turn.turns == 0


async def test_an_unreadable_session_starts_over(settings, r):
    sessions = Sessions(r, settings.keys)
    await r.set(sessions.key("", "torn"), b"\x93not ours")
    turn = await sessions.begin("", "torn", FIRST)
    assert turn.prefix_ids is None
