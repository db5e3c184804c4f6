"""Parts of partial output: one piece of a checkpoint, and of a streamed request, its chunk.

A part is 8 hex digits of length, then one MessagePack map (:class:`Part`). A checkpoint
(``{tag}:partial:<request_id>``) is a header and its parts end to end. A producer's chunk stream
(``{tag}:chunks:<producer>``) has one entry per worker call that saved parts of its streamed
requests: per part a field ``<request_id> <offset> <tokens>`` (the tokens before it, the tokens in
it) whose value is the part, byte for byte, written in the same call as the checkpoint.
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


def chunks_by_request(fields: dict[Any, Any]) -> dict[str, list[tuple[int, bytes]]]:
    """A chunk stream entry's chunks by request_id: each (offset, part bytes), in order. A field
    that does not name a chunk (a foreign writer's) is passed over."""
    out: dict[str, list[tuple[int, bytes]]] = {}
    for name, data in fields.items():
        head = name.decode() if isinstance(name, bytes) else str(name)
        parts = head.rsplit(" ", 2)
        if len(parts) != 3 or not parts[1].isdigit():
            continue
        out.setdefault(parts[0], []).append((int(parts[1]), data))
    return out


def part_of(data: bytes) -> Part | None:
    """The part a chunk holds (8 hex digits of length, then its map); None when it is not one."""
    try:
        return decode_part(data[8:8 + int(data[:8], 16)])
    except (ValueError, TypeError, msgspec.DecodeError):
        return None


__all__ = ["Part", "chunks_by_request", "decode_part", "encode_part", "part_of"]
