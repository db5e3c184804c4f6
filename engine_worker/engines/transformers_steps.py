"""The transformers engine's model steps: prefill (with and without the prefix cache), decode,
and the KV tensors they pass around (a mixin of :class:`.transformers_engine.TransformersEngine`).

The ``_prefill_step`` / ``_prefill_step_cached`` / ``_decode_step`` methods run in a worker thread
(``asyncio.to_thread``) under the engine's step lock; the prefix-cache methods run on the event loop.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from redroll.engine_worker.engines.base import EngineInfo
from redroll.engine_worker.engines.prefix_cache import KV, PrefixCache
from redroll.engine_worker.engines.transformers_batch import _Decoder, _Job, _Prefill, _Row, _Sampling
from redroll.engine_worker.engines.transformers_sampling import _prompt_logprobs, _sample, _top_k

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


class TransformersSteps:
    """Mixin: needs the engine's model, its forward conventions, its prefix cache and counters."""

    info: EngineInfo
    _model: Any
    _pad_id: int
    _cache_kwarg: str
    _extra_forward_kwargs: dict[str, Any]
    prefix_cache: PrefixCache | None
    prefill_tokens_computed: int
    prefill_tokens_cached: int
    _weights_generation: int

    # ------------------------------------------------------------ the prefix cache (event loop)

    async def _prefill_cached(
        self, rows: list[_Row], banned: list[tuple[int, int]], sampling: _Sampling
    ) -> tuple[_Decoder, list[int], list[float], list[list[tuple[int, float]]] | None]:
        """Prefill with the prefix cache (under the step lock): look up each distinct prompt, run
        the suffixes, store the prompts' KV."""
        cache = self.prefix_cache
        assert cache is not None
        version, generation = str(self.info.weight_version), self._weights_generation
        prefills: dict[tuple[int, ...], _Prefill] = {}
        owners: dict[tuple[int, ...], _Job] = {}
        for i, row in enumerate(rows):
            prompt = tuple(row.job.prompt_ids)
            prefill = prefills.setdefault(prompt, _Prefill(prompt, []))
            prefill.rows.append(i)
            prefill.all_logits |= row.index == 0 and row.job.request.logprob_start_len is not None
            owners.setdefault(prompt, row.job)
        for prefill in prefills.values():
            if not prefill.all_logits:  # (prompt logprobs need every position's logits)
                prefill.cached, prefill.past = cache.lookup(prefill.prompt, version, limit=len(prefill.prompt) - 1)
        jobs = list(dict.fromkeys(row.job for row in rows))
        for job in jobs:
            prompt = tuple(job.prompt_ids)
            job.cached_tokens = prefills[prompt].cached if owners[prompt] is job else len(prompt)
            self.prefill_tokens_cached += job.cached_tokens
        result = await asyncio.to_thread(self._prefill_step_cached, rows, list(prefills.values()), banned, sampling)
        if generation == self._weights_generation:
            for prefill in prefills.values():
                if prefill.kv is not None:
                    cache.insert(prefill.prompt, prefill.kv, version)
        return result

    async def _store_conversations(self, rows: list[_Row], decoder: _Decoder, version: str, generation: int) -> None:
        """Store each row's prompt + output but the last token (whose KV was never computed), unless
        the weights changed since the prefill (the KV would mix two versions)."""
        cache = self.prefix_cache
        assert cache is not None
        wanted: dict[tuple[int, ...], int] = {}
        for i, row in enumerate(rows):
            sequence = (*row.job.prompt_ids, *row.token_ids[:-1])
            if len(row.token_ids) > 1 and len(sequence) <= cache.capacity_tokens:
                wanted.setdefault(sequence, i)
        if not wanted or generation != self._weights_generation:
            return
        slices = [(i, len(rows[i].job.prompt_ids), len(sequence)) for sequence, i in wanted.items()]
        kvs = await asyncio.to_thread(_slice_rows, decoder, slices)
        if generation != self._weights_generation:
            return
        for sequence, kv in zip(wanted, kvs):
            cache.insert(sequence, kv, version)

    # ------------------------------------------------------------ torch work (worker thread)

    def _prefill_step(
        self, rows: list[_Row], banned: list[tuple[int, int]], sampling: _Sampling
    ) -> tuple[_Decoder, list[int], list[float], list[list[tuple[int, float]]] | None]:
        """Run the left-padded prompts through the model and sample every row's first token (and
        the prompt logprobs of the jobs that asked for them)."""
        import torch

        device = self._model.device
        prompts = [row.job.prompt_ids for row in rows]
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(rows), width), self._pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            input_ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[i, width - len(prompt) :] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
        self.prefill_tokens_computed += sum(len(p) for p in prompts)
        want_prompt = [row.index == 0 and row.job.request.logprob_start_len is not None for row in rows]
        with torch.inference_mode():
            logits, cache = self._forward(input_ids, attention_mask, position_ids, cache=None,
                                          all_positions=any(want_prompt))
            if any(want_prompt):
                for i, row in enumerate(rows):
                    if want_prompt[i]:
                        row.job.input_logprobs = _prompt_logprobs(logits[i], prompts[i], sampling.temperature[i],
                                                                  row.job.request.logprob_start_len)
                logits = logits[:, -1, :]
            decoder = _Decoder(cache, attention_mask, position_ids[:, -1] + 1, width)
            tokens, logprobs, tops = _sample(logits, sampling, [True] * len(rows), banned, _top_k(rows))
        return decoder, tokens, logprobs, tops

    def _prefill_step_cached(
        self, rows: list[_Row], prefills: list[_Prefill], banned: list[tuple[int, int]], sampling: _Sampling
    ) -> tuple[_Decoder, list[int], list[float], list[list[tuple[int, float]]] | None]:
        """Prefill each distinct prompt alone, on top of its cached prefix, then lay the rows out as
        :meth:`_prefill_step` does (left padded, positions 0..len-1) and sample the first tokens."""
        import torch

        device = self._model.device
        last_logits: list[Any] = [None] * len(rows)
        with torch.inference_mode():
            for prefill in prefills:
                prompt, start = prefill.prompt, prefill.cached
                suffix = torch.tensor([prompt[start:]], dtype=torch.long, device=device)
                positions = torch.arange(start, len(prompt), dtype=torch.long, device=device).unsqueeze(0)
                attention_mask = torch.ones((1, len(prompt)), dtype=torch.long, device=device)
                past = _dynamic_cache(prefill.past) if prefill.past is not None else None
                logits, cache = self._forward(suffix, attention_mask, positions, past, all_positions=prefill.all_logits)
                self.prefill_tokens_computed += suffix.shape[-1]
                prefill.kv = _kv_layers(cache)
                if prefill.all_logits:
                    for i in prefill.rows:
                        row = rows[i]
                        if row.index == 0 and row.job.request.logprob_start_len is not None:
                            row.job.input_logprobs = _prompt_logprobs(logits[0], list(prompt), sampling.temperature[i],
                                                                      row.job.request.logprob_start_len)
                    logits = logits[:, -1, :]
                for i in prefill.rows:
                    last_logits[i] = logits[0]
            lengths = [len(row.job.prompt_ids) for row in rows]
            width = max(lengths)
            attention_mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
            for i, length in enumerate(lengths):
                attention_mask[i, width - length:] = 1
            layers: KV = []
            for layer, (keys0, values0) in enumerate(prefills[0].kv or []):
                keys = keys0.new_zeros((len(rows), keys0.shape[1], width, keys0.shape[3]))
                values = values0.new_zeros((len(rows), values0.shape[1], width, values0.shape[3]))
                for prefill in prefills:
                    k, v = (prefill.kv or [])[layer]
                    for i in prefill.rows:
                        keys[i, :, width - lengths[i]:] = k[0]
                        values[i, :, width - lengths[i]:] = v[0]
                layers.append((keys, values))
            next_position = torch.tensor(lengths, dtype=torch.long, device=device)
            decoder = _Decoder(_dynamic_cache(layers), attention_mask, next_position, width)
            tokens, logprobs, tops = _sample(torch.stack(last_logits), sampling, [True] * len(rows), banned,
                                             _top_k(rows))
        return decoder, tokens, logprobs, tops

    def _decode_step(
        self,
        decoder: _Decoder,
        tokens: list[int],
        active: list[bool],
        banned: list[tuple[int, int]],
        sampling: _Sampling,
    ) -> tuple[list[int], list[float], list[list[tuple[int, float]]] | None]:
        """Feed the last sampled tokens (pad for finished rows) and sample the next ones."""
        import torch

        device = self._model.device
        fed = [token if on else self._pad_id for token, on in zip(tokens, active)]
        input_ids = torch.tensor(fed, dtype=torch.long, device=device).unsqueeze(-1)
        ones = torch.ones((len(fed), 1), dtype=decoder.attention_mask.dtype, device=device)
        with torch.inference_mode():
            decoder.attention_mask = torch.cat([decoder.attention_mask, ones], dim=-1)
            position_ids = decoder.next_position.unsqueeze(-1)
            logits, decoder.cache = self._forward(input_ids, decoder.attention_mask, position_ids, decoder.cache)
            decoder.next_position = decoder.next_position + 1
            return _sample(logits, sampling, active, banned, sampling.top_logprobs)

    def _forward(
        self, input_ids: "torch.Tensor", attention_mask: "torch.Tensor", position_ids: "torch.Tensor", cache: Any,
        all_positions: bool = False,
    ) -> tuple["torch.Tensor", Any]:
        """Last-position logits (float32; every position's with ``all_positions``) and the updated KV cache."""
        kwargs = dict(self._extra_forward_kwargs)
        if all_positions and "logits_to_keep" in kwargs:
            kwargs["logits_to_keep"] = 0  # (0: every position)
        if cache is not None:
            kwargs[self._cache_kwarg] = cache
        out = self._model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True, **kwargs
        )
        new_cache = getattr(out, "cache", None)
        if new_cache is None:
            new_cache = out.past_key_values
        return (out.logits if all_positions else out.logits[:, -1, :]).float(), new_cache


# ---------------------------------------------------------------- KV tensors


def _kv_layers(cache: Any) -> KV:
    """Per layer (keys, values) ``[batch, heads, positions, head_dim]`` of a transformers cache that
    keeps every position (a DynamicCache of full-attention layers); ValueError for any other."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        kinds = {type(layer).__name__ for layer in layers}
        if kinds != {"DynamicLayer"}:
            raise ValueError(f"cache layers {sorted(kinds)} do not keep every position")
        return [(layer.keys, layer.values) for layer in layers]
    if hasattr(cache, "key_cache"):  # transformers 4.x before cache layers
        return list(zip(cache.key_cache, cache.value_cache))
    raise ValueError(f"{type(cache).__name__} is not a dynamic KV cache")


def _dynamic_cache(layers: KV) -> Any:
    """A DynamicCache holding copies of ``layers`` (the tensors given are never written to)."""
    from transformers import DynamicCache

    return DynamicCache([(k, v) for k, v in layers])


def _slice_rows(decoder: _Decoder, slices: list[tuple[int, int, int]]) -> list[KV]:
    """For each (row, prompt length, sequence length), the KV of that row's first ``sequence
    length`` real tokens, copied out of the batch cache (``[1, heads, length, head_dim]``)."""
    import torch

    layers = _kv_layers(decoder.cache)
    out: list[KV] = []
    with torch.inference_mode():
        for row, prompt_length, length in slices:
            start = decoder.width - prompt_length
            out.append([(k[row:row + 1, :, start:start + length].clone(), v[row:row + 1, :, start:start + length].clone())
                        for k, v in layers])
    return out


def _check_prefix_cache_support(model: Any) -> None:
    """Refuse a model whose KV cache does not keep every position of every layer (sliding
    window, linear attention): its KV cannot be sliced by prefix."""
    import torch

    with torch.inference_mode():
        ids = torch.zeros((1, 1), dtype=torch.long, device=model.device)
        out = model(input_ids=ids, use_cache=True)
    cache = getattr(out, "cache", None)
    try:
        _kv_layers(cache if cache is not None else out.past_key_values)
    except ValueError as exc:
        raise ValueError(f"prefix_cache_tokens needs a model with a full-attention KV cache: {exc}") from None
