"""TRL's own ``VLLMClient`` (trl 1.16.0, ``trl/generation/vllm_client.py``, unmodified) against
``redroll serve``: its ``generate`` and ``chat`` give the prompt ids, completion ids and logprobs
that the same requests give through redroll's Python API. Shared by the transformers-worker test
(tests/test_gateway_rl.py) and the vLLM-worker one (tests/vllm/test_vllm_gateway.py).

What the client sends (read at trl 1.16.0): ``generate`` POSTs ``/v1/completions`` with
``return_token_ids``, ``return_tokens_as_token_ids``, ``top_k: 0``, ``min_p``, ``repetition_penalty``,
``logprobs: 0`` and ``generation_kwargs`` merged last (vllm_client.py:431-453), and reads each
choice's ``prompt_token_ids`` (one per prompt), ``token_ids`` and ``logprobs`` (:455-460);
``chat`` POSTs ``/v1/chat/completions`` once per conversation with ``logprobs: true,
top_logprobs: 0`` and ``chat_template_kwargs`` (:579-609), and reads the top-level
``prompt_token_ids`` (:614-618). ``parse_logprobs`` (:95-136) zips the tokens with their
``top_logprobs``, which must be lists (not null), the sampled token merged in.
"""

from __future__ import annotations

import asyncio
from typing import Any
from unittest import mock

import pytest

from redroll.producer.client import Producer

PROMPTS_TEXT = ["The quick brown fox", "A queue of requests"]
CHAT = [[{"role": "user", "content": "a queue of requests"}], [{"role": "system", "content": "be brief"},
                                                                {"role": "user", "content": "the worker"}]]
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
"""VLLMClient's defaults (top_k 0 is vLLM's off, redroll's -1), as the Python API takes them."""


def vllm_client(base_url: str) -> Any:
    """TRL's client. Its constructor refuses where vLLM is not installed (vllm_client.py:215-216),
    though generation needs nothing of vLLM: there (the main .venv), and only there, the module's
    ``is_vllm_available`` is patched for the constructor; with vLLM installed nothing is patched."""
    trl_client = pytest.importorskip("trl.generation.vllm_client")
    if trl_client.is_vllm_available():
        return trl_client.VLLMClient(base_url=base_url, connection_timeout=120)
    with mock.patch.object(trl_client, "is_vllm_available", return_value=True):
        return trl_client.VLLMClient(base_url=base_url, connection_timeout=120)


def approx(values: list) -> Any:
    return pytest.approx(values, abs=1e-4)


async def check_generate(client: Any, producer: Producer, prompt_ids: list[list[int]]) -> None:
    """``VLLMClient.generate`` with token-id prompts and with text prompts, n = 2, seeded: the same
    ids and logprobs as the Python API's requests, and the prompt ids the worker ran."""
    for prompts in (prompt_ids, PROMPTS_TEXT):
        out = await asyncio.to_thread(client.generate, prompts, n=2, max_tokens=8,
                                      generation_kwargs={"seed": 7, "ignore_eos": True})
        records = await asyncio.gather(*(producer.generate(
            **({"input_ids": p} if isinstance(p, list) else {"prompt": p, "return_prompt_token_ids": True}),
            sampling_params={**SAMPLING, "n": 2, "max_new_tokens": 8, "sampling_seed": 7, "ignore_eos": True},
            return_logprob=True, timeout=300) for p in prompts))
        want_prompts = [p if isinstance(p, list) else rec.prompt_token_ids for p, rec in zip(prompts, records)]
        assert out["prompt_ids"] == want_prompts and all(want_prompts)
        want_ids = [ids for rec in records for ids in rec.output_token_ids]
        assert out["completion_ids"] == want_ids and all(len(ids) == 8 for ids in want_ids)
        want_lps = [lps for rec in records for lps in rec.output_logprobs]
        # logprobs: 0 is the sampled token alone, per position ([seq][pos][k] with k = 1)
        assert out["logprob_token_ids"] == [[[t] for t in ids] for ids in want_ids]
        for got, want in zip(out["logprobs"], want_lps):
            assert [lp for (lp,) in got] == approx(want)


async def check_chat(client: Any, producer: Producer) -> None:
    """``VLLMClient.chat``, n = 2, seeded, with chat_template_kwargs: the prompt ids the worker's
    template rendered, and the completion ids and logprobs of the same chat through the Python API."""
    out = await asyncio.to_thread(client.chat, CHAT, n=2, max_tokens=8, chat_template_kwargs={"enable_thinking": False},
                                  generation_kwargs={"seed": 11, "ignore_eos": True})
    records = await asyncio.gather(*(producer.generate(
        messages=chat, chat_template_kwargs={"enable_thinking": False}, return_prompt_token_ids=True,
        sampling_params={**SAMPLING, "n": 2, "max_new_tokens": 8, "sampling_seed": 11, "ignore_eos": True},
        return_logprob=True, timeout=300) for chat in CHAT))
    assert out["prompt_ids"] == [rec.prompt_token_ids for rec in records] and all(out["prompt_ids"])
    want_ids = [ids for rec in records for ids in rec.output_token_ids]
    assert out["completion_ids"] == want_ids
    assert out["logprob_token_ids"] == [[[t] for t in ids] for ids in want_ids]
    for got, want in zip(out["logprobs"], [lps for rec in records for lps in rec.output_logprobs]):
        assert [lp for (lp,) in got] == approx(want)


__all__ = ["CHAT", "PROMPTS_TEXT", "check_chat", "check_generate", "vllm_client"]
