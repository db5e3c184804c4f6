"""A checkpoint_many call's typed messages: one save of one request's partial output, and the
call's per-save outcomes (the function itself: ``shared/lua/checkpoint_many.lua``, called by
:meth:`redroll.shared.checkpoint_calls.CheckpointCalls.checkpoint_many_in`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence


@dataclass(frozen=True)
class CheckpointSave:
    """One part of one request's partial output to save (see :meth:`Scripts.checkpoint_many_in`)."""

    requests_key: str
    """The request stream the entry is on (its lease is read there)."""
    partial_key: str
    """The checkpoint's key (``{tag}:partial:<request_id>``)."""
    entry_id: str
    """The request entry the checkpoint belongs to."""
    saved: int
    """Tokens the writer has saved of this entry so far (the checkpoint must hold as many)."""
    adding: int
    """Tokens in this part."""
    part: bytes
    """The part, as :func:`redroll.shared.chunks.encode_part` makes it."""
    chunks_key: str | None = None
    """A streamed request's producer's chunk stream (the part is also the request's next chunk)."""
    owner_key: str | None = None
    """With ``chunks_key``: the ownership hash that must name the entry."""
    logged: bool = True
    """The save goes into the request's event log (when the log is on)."""
    number: int = 1
    """Which of its writer's saves of the entry this is (the event line counts them)."""
    refresh_ttl: bool = True
    """With ``chunks_key``: set the chunk stream's TTL again (a new stream always gets it)."""
    check_owner: bool = True
    """With ``chunks_key``: check that ``owner_key`` names the entry (a writer's first save of it)."""
    length: int | None = None
    """The bytes the checkpoint held after this writer's last save of it (its next saves): the
    append is checked against it instead of reading the header first."""
    prior: bytes = b""
    """The parts of this request saved since the checkpoint's last consolidation (each as
    :func:`~redroll.shared.chunks.encode_part` makes it, end to end), appended before ``part``."""
    prior_tokens: int = 0
    """Tokens in ``prior``."""

    @property
    def count(self) -> int:
        """Tokens the checkpoint holds once this save is appended."""
        return self.saved + self.prior_tokens + self.adding


@dataclass(frozen=True)
class PartSave:
    """One part of one request's partial output added to its worker's parts stream (see
    :meth:`~redroll.shared.checkpoint_calls.CheckpointCalls.save_parts_in`)."""

    requests_key: str
    entry_id: str
    request_id: str
    before: int
    """Tokens of the request's output before this part."""
    adding: int
    """Tokens in this part."""
    part: bytes
    chunks_key: str | None = None
    """A streamed request's producer's chunk stream, when this part is also its next chunk."""
    refresh_ttl: bool = False
    """With ``chunks_key``: set the chunk stream's TTL again."""


def checkpoint_outcomes(reply: Sequence[Any]) -> list[tuple[int, int | str]]:
    """The per-save outcomes of a checkpoint_many call's reply."""
    return [(int(reply[i]), reply[i + 1] if isinstance(reply[i + 1], int) else _text(reply[i + 1]))
            for i in range(0, len(reply), 2)]


def checkpoint_refused(n: int) -> Callable[[str], list]:
    """The reply of a checkpoint_many call of ``n`` saves refused as a whole with a message."""
    return lambda message: [2, message] * n



def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


__all__ = ["CheckpointSave", "PartSave", "checkpoint_outcomes", "checkpoint_refused"]
