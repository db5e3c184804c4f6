"""Token-exact sessions on the gateway: a chat's turn k + 1 runs on turn k's prompt ids + completion
ids + the new messages' ids, never on the conversation rendered again as text.

A call names its session with the ``X-Session-Id`` header or vLLM's ``session_id`` field. The
gateway keeps the conversation's token ids server-side, in Redis (:meth:`Keys.session`: one string
under the pipeline's hash tag, expiring after the session's window), so any gateway replica serves
the next turn and a replica's death loses nothing. Server-side rather than sent back by the client
(vLLM's token-id prompts): agent frameworks speak plain OpenAI chat, send the whole conversation
every turn and keep no ids; the gateway tells the new part from what the session already holds.

What the session holds (:class:`SessionState`, MessagePack): the ids (the last turn's prompt as the
engine ran it + its completion), how many messages they cover (the call's messages + the assistant
reply the gateway returned) and a digest of those messages. A call whose messages begin with
exactly the covered ones (the reply as returned: content, tool calls by id, name and arguments)
is a continuation: its request carries ``prefix_ids`` = the session's ids and ``messages`` = the
new ones, and the worker renders the new part alone (``engine_worker/engines/text.py``:
``render_continuation``). Any other call (the first, an edited history, another reply, a session
past its window) renders its messages whole and starts the session over from them. A turn is kept
once its record is finished, before the response (or the stream's last event) is sent, so the
next call finds it. Only chats with one choice (``n`` = 1) keep a session: with several choices
there is no one reply to go on from. Two calls of one session at once each extend what they
read; the one that finishes last is kept.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import msgspec

from redroll.shared.keys import Keys
from redroll.shared.types import CompletionRecord

DEFAULT_WINDOW_S = 3600
"""How long a session's ids are kept after its last turn (``redroll serve --session-window``)."""


class SessionState(msgspec.Struct, array_like=True):
    """What Redis holds for one session."""

    ids: list[int]
    """The conversation's token ids: the last turn's prompt (as the engine ran it) + its completion."""
    covered: int
    """How many of the client's messages ``ids`` cover (the last call's messages + the reply)."""
    digest: str
    """The digest (:func:`digest`) of those messages."""
    turns: int = 1


def _canonical(message: Any) -> Any:
    """What identifies a message for a session: its role, text, tool calls (id, name, arguments),
    tool_call_id and name; absent and null content are the same (a reply that only called tools)."""
    if not isinstance(message, dict):
        return message
    calls = [[c.get("id"), (c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments")]
             for c in message.get("tool_calls") or () if isinstance(c, dict)]
    content = message.get("content")
    return [message.get("role"), "" if content is None else content, calls, message.get("tool_call_id"),
            message.get("name")]


def digest(messages: list[Any]) -> str:
    return hashlib.sha256(json.dumps([_canonical(m) for m in messages], ensure_ascii=False, sort_keys=True,
                                     separators=(",", ":")).encode()).hexdigest()


@dataclass
class SessionTurn:
    """One call of a session: what its request sends, and what the session becomes after it."""

    key: str
    messages: list[Any]
    """The call's whole conversation."""
    prefix_ids: list[int] | None
    """The session's ids when the call continues it; None: rendered whole (the session starts over)."""
    new_messages: list[Any]
    """What the request sends as ``messages``: the new ones after ``prefix_ids``, else all."""
    turns: int

    def after(self, record: CompletionRecord, reply: dict[str, Any]) -> SessionState | None:
        """The session once ``record`` (this turn's, finished) answered with ``reply`` (the assistant
        message returned); None when the record holds no ids to go on from."""
        if record.prompt_token_ids is None or not record.output_token_ids:
            return None
        covered = [*self.messages, reply]
        return SessionState(ids=[*record.prompt_token_ids, *record.output_token_ids[0]], covered=len(covered),
                            digest=digest(covered), turns=self.turns + 1)


class Sessions:
    """The sessions of one pipeline: read and written by every gateway replica."""

    def __init__(self, redis: Any, keys: Keys, window_s: int = DEFAULT_WINDOW_S):
        self.redis = redis
        self.keys = keys
        self.window_s = window_s

    def key(self, scope: str, session_id: str) -> str:
        """The session's key: a hash of the caller's scope (its API key's) and the session id, so
        that callers with other keys never share (or read) a session of the same name."""
        return self.keys.session(hashlib.sha256(f"{scope}\x00{session_id}".encode()).hexdigest()[:32])

    async def begin(self, scope: str, session_id: str, messages: list[Any]) -> SessionTurn:
        """The turn a call makes of its session: a continuation when its messages extend the
        session's, else the session's first turn (again)."""
        key = self.key(scope, session_id)
        raw = await self.redis.get(key)
        state = None
        if raw is not None:
            try:
                state = msgspec.msgpack.decode(raw, type=SessionState)
            except (msgspec.DecodeError, msgspec.ValidationError):
                state = None  # (not ours, or torn: start over)
        if (state is not None and state.ids and len(messages) > state.covered
                and digest(messages[:state.covered]) == state.digest):
            return SessionTurn(key, messages, list(state.ids), messages[state.covered:], state.turns)
        return SessionTurn(key, messages, None, messages, 0)

    async def keep(self, turn: SessionTurn, record: CompletionRecord, reply: dict[str, Any]) -> None:
        """Keep the session as ``turn`` left it (its window starts again)."""
        state = turn.after(record, reply)
        if state is not None:
            await self.redis.set(turn.key, msgspec.msgpack.encode(state), ex=self.window_s)


__all__ = ["DEFAULT_WINDOW_S", "SessionState", "SessionTurn", "Sessions", "digest"]
