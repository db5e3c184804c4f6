"""Logprobs in the shapes vLLM's OpenAI server returns them, built from redroll's records.

A record has, per sampled token, its logprob and (when the call asked for k > 0) the k most likely
tokens with theirs. vLLM's engine keeps one candidate map per position: the sampled token first,
then the most likely tokens in rank order (the sampled one not repeated). Its endpoints cut that
map differently, and so does the gateway:

* completions (``logprobs: k``): the first k + 1 candidates, a map ``{"token_id:<id>": logprob}``;
  ``logprobs: 0`` is the sampled token alone;
* chat (``top_logprobs: k``): the first k candidates, a list (``top_logprobs: 0`` is empty);
* ``/inference/v1/generate`` (``sampling_params.logprobs: k``): the first max(k, 1) candidates, a
  list of ``{"token_id", "logprob", "rank"}``.

The gateway holds no tokenizer: a token is named ``token_id:<id>`` (vLLM's
``return_tokens_as_token_ids`` form). Ranks are not known (null), nor is a token's decoded text.
"""

from __future__ import annotations

from typing import Any, Sequence

LOGPROB_FLOOR = -9999.0
"""What ``-inf`` becomes in JSON, as in vLLM's and OpenAI's responses."""

Top = Sequence[tuple[int, float]]


def token_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def clamp(logprob: float | None) -> float | None:
    return None if logprob is None else max(logprob, LOGPROB_FLOOR)


def candidates(token_id: int, logprob: float | None, top: Top | None) -> list[tuple[int, float | None]]:
    """vLLM's candidate map of one position: the sampled token first, then the most likely."""
    out: list[tuple[int, float | None]] = [(token_id, logprob)]
    for t, lp in top or ():
        if t != token_id:
            out.append((t, lp))
    return out


def _tops(ids: Sequence[int], tops: Sequence[Top] | None) -> Sequence[Top | None]:
    return tops if tops is not None and len(tops) == len(ids) else [None] * len(ids)


def _logprobs(ids: Sequence[int], logprobs: Sequence[float | None] | None) -> Sequence[float | None]:
    return logprobs if logprobs is not None and len(logprobs) == len(ids) else [None] * len(ids)


def completion_logprobs(ids: Sequence[int], logprobs: Sequence[float | None] | None, tops: Sequence[Top] | None,
                        k: int) -> dict[str, Any]:
    """A completions choice's ``logprobs``: tokens, their logprobs, and per token its first k + 1
    candidates."""
    lps = _logprobs(ids, logprobs)
    return {"text_offset": [], "token_logprobs": [clamp(lp) for lp in lps],
            "tokens": [token_name(t) for t in ids],
            "top_logprobs": [{token_name(c): clamp(clp) for c, clp in candidates(t, lp, top)[:k + 1]}
                             for t, lp, top in zip(ids, lps, _tops(ids, tops))]}


def chat_logprobs(ids: Sequence[int], logprobs: Sequence[float | None] | None, tops: Sequence[Top] | None,
                  k: int) -> dict[str, Any]:
    """A chat choice's ``logprobs``: per token its logprob and its first k candidates."""
    lps = _logprobs(ids, logprobs)
    content = []
    for t, lp, top in zip(ids, lps, _tops(ids, tops)):
        first = candidates(t, lp, top)[:k]
        content.append({"token": token_name(t), "logprob": clamp(lp), "bytes": None,
                        "top_logprobs": [{"token": token_name(c), "logprob": clamp(clp),
                                          "bytes": list(token_name(c).encode())} for c, clp in first]})
    return {"content": content}


def generate_logprobs(ids: Sequence[int], logprobs: Sequence[float | None] | None, tops: Sequence[Top] | None,
                      k: int) -> dict[str, Any]:
    """A ``/inference/v1/generate`` choice's ``logprobs`` (integer token ids)."""
    lps = _logprobs(ids, logprobs)
    return {"content": [
        {"token_id": t, "logprob": clamp(lp), "rank": None,
         "top_logprobs": [{"token_id": c, "logprob": clamp(clp), "rank": None}
                          for c, clp in candidates(t, lp, top)[:max(k, 1)]]}
        for t, lp, top in zip(ids, lps, _tops(ids, tops))]}


def prompt_logprobs(prompt_ids: Sequence[int] | None, input_logprobs: Sequence[float | None] | None
                    ) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs`` (``prompt_logprobs: 0``): per prompt position ``{"<id>": {"logprob",
    "rank", "decoded_token"}}`` for the prompt's own token, null for the first (it has none)."""
    if prompt_ids is None or input_logprobs is None:
        return None
    out: list[dict[str, Any] | None] = []
    for t, lp in zip(prompt_ids, input_logprobs):
        out.append(None if lp is None else {str(t): {"logprob": clamp(lp), "rank": None, "decoded_token": None}})
    return out


__all__ = ["LOGPROB_FLOOR", "candidates", "chat_logprobs", "clamp", "completion_logprobs", "generate_logprobs",
           "prompt_logprobs", "token_name"]
