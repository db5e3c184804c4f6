"""An LRU of KV tensors keyed by token sequences, for the transformers engine's prefill.

Like SGLang's radix cache in what it answers, not in how: each entry is one token sequence with
the per-layer key/value tensors of every one of its positions (``[1, heads, len, head_dim]``,
computed by one model on one weight version). A prompt's cached prefix is its longest common
prefix with any entry of the current weight version: causal attention makes the KV of the
first ``k`` positions a function of the first ``k`` tokens only, so any entry that starts the
same way serves them. Entries do not share storage; the capacity counts every entry's tokens.

Lookups are a linear scan over the entries (prefix comparisons run in C on tuple slices), which
is plenty for the few hundred entries a CPU or test engine holds. Not thread-safe: the engine
touches it from its event loop only.

torch is not imported here: the cache stores whatever tensors it is given and only slices them.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Sequence

KV = list[tuple[Any, Any]]
"""Per layer, (keys, values) shaped ``[1, heads, tokens, head_dim]``."""


@dataclass(eq=False)
class _Entry:
    tokens: tuple[int, ...]
    kv: KV
    version: str


class PrefixCache:
    """At most ``capacity_tokens`` tokens of KV, least recently used evicted first."""

    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 1:
            raise ValueError("capacity_tokens must be at least 1")
        self.capacity_tokens = capacity_tokens
        self._entries: collections.OrderedDict[tuple[int, ...], _Entry] = collections.OrderedDict()
        """Least recently used first."""
        self._tokens = 0

    @property
    def tokens(self) -> int:
        """Tokens stored, over all entries."""
        return self._tokens

    def __len__(self) -> int:
        return len(self._entries)

    def sequences(self) -> list[tuple[int, ...]]:
        """The stored token sequences, least recently used first."""
        return list(self._entries)

    def lookup(self, tokens: Sequence[int], version: str, limit: int | None = None) -> tuple[int, KV | None]:
        """The longest cached prefix of ``tokens`` (at most ``limit`` tokens) made on ``version``:
        its length and its KV (views into the stored tensors; do not write to them), or
        ``(0, None)``. The entry it came from becomes the most recently used."""
        wanted = tuple(tokens)
        if limit is not None:
            wanted = wanted[:limit]
        best: _Entry | None = None
        best_length = 0
        for entry in self._entries.values():
            if entry.version != version:
                continue
            length = _common_prefix(entry.tokens, wanted)
            if length > best_length:
                best, best_length = entry, length
                if length == len(wanted):
                    break
        if best is None:
            return 0, None
        self._entries.move_to_end(best.tokens)
        return best_length, [(k[:, :, :best_length], v[:, :, :best_length]) for k, v in best.kv]

    def insert(self, tokens: Sequence[int], kv: KV, version: str) -> bool:
        """Store ``kv`` (one position per token of ``tokens``) for ``version``; True if stored.

        Not stored: an empty sequence, one longer than the capacity, or one that an entry of the
        same version already covers (that entry is refreshed instead). Entries the new one covers
        (its prefixes) and entries of other versions are dropped; then least recently used
        entries are evicted until the cache is within its capacity.
        """
        key = tuple(tokens)
        size = len(key)
        if not size or size > self.capacity_tokens:
            return False
        for entry in list(self._entries.values()):
            if entry.version != version or entry.tokens == key[:len(entry.tokens)]:
                self._drop(entry)  # stale, or a prefix of the new one
            elif entry.tokens[:size] == key:
                self._entries.move_to_end(entry.tokens)
                return False
        self._entries[key] = _Entry(key, kv, version)
        self._tokens += size
        while self._tokens > self.capacity_tokens:
            self._drop(next(iter(self._entries.values())))
        return True

    def clear(self) -> None:
        """Drop every entry (the weights changed)."""
        self._entries.clear()
        self._tokens = 0

    def _drop(self, entry: _Entry) -> None:
        del self._entries[entry.tokens]
        self._tokens -= len(entry.tokens)


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low


__all__ = ["KV", "PrefixCache"]
