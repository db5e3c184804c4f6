"""Parts of partial output: one piece of a checkpoint, and of a streamed request, its chunk.

A part is 8 hex digits of length, then one MessagePack map (:class:`Part`). A checkpoint
(``{tag}:partial:<request_id>``) is a header and its parts end to end; a streamed request's chunk
stream (``{tag}:chunks:<producer>}<request_id>``) has one entry per part, written in the same call:
``rid``, ``offset`` (the tokens before it), ``tokens`` (in it) and ``data`` (the part, byte for byte).
"""

from __future__ import annotations

from typing import Any

import msgspec


class Part(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One appended piece of partial output (8 hex digits of length, then this as MessagePack)."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    weight_version: str | None = None
    """The version that made every token of this part ..."""
    weight_versions: list[str] | None = None
    """... or, when an in-place update fell inside it, the version of each token."""
    worker: str
    finish_reason: str | None = None
    text: str | None = None
    """A streamed request's text of these tokens (what its chunk says), when it wants text."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """A streamed request's k most likely (token id, logprob) pairs per token (``top_logprobs_num``)."""

    def versions(self) -> list[str]:
        return list(self.weight_versions) if self.weight_versions else [str(self.weight_version)] * len(self.token_ids)


_encode = msgspec.msgpack.Encoder().encode
decode_part = msgspec.msgpack.Decoder(Part).decode
"""A part's MessagePack map (without its 8-digit length) as a :class:`Part`."""


def encode_part(part: Part) -> bytes:
    body = _encode(part)
    return b"%08x" % len(body) + body


def chunk_of(fields: dict[Any, Any]) -> tuple[int, Part] | None:
    """A chunk stream entry's offset and part; None when the entry is not one (a foreign writer)."""
    try:
        offset = int(fields[b"offset"])
        data = fields[b"data"]
        size = int(data[:8], 16)
        return offset, decode_part(data[8:8 + size])
    except (KeyError, ValueError, TypeError, msgspec.DecodeError):
        return None


__all__ = ["Part", "chunk_of", "decode_part", "encode_part"]
