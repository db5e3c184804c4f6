"""A complete engine in one short file: the example to copy when writing an engine of your own.

It runs no model. Its "model" spells the prompt back one byte per token, at ``token_ms`` per
token — enough to show every part of the contract in :mod:`.base`:

* ``capacity``: at most ``capacity`` generations run at once (a semaphore stands for the batch);
* text: a byte :class:`ByteLevelText` tokenizer with a one-line chat template, so ``prompt`` and
  ``messages`` requests work and records carry ``output_text``;
* streaming: :meth:`ExampleEngine.partial` shows what a running request has made, so streamed
  requests stream and long ones can be continued by another worker after this one dies;
* ``abort``: a generation stops between two tokens and returns what it made, finish reason ``abort``;
* errors: what ``validate`` refuses never reaches ``generate``; a failure of one request would be
  :class:`~.base.EngineRequestError`, a dead engine :class:`~.base.EngineDeadError`.

Run it: ``redroll worker --engine redroll.engine_worker.engines.example:ExampleEngine``
(``--engine-arg token_ms=20`` for slower tokens).
"""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

from redroll.engine_worker.engines.base import EngineCapabilities, EngineInfo, EngineOutput, SampleOutput
from redroll.engine_worker.engines.checks import check_token_ids, refuse_extras
from redroll.engine_worker.engines.text import add_text, render_chat
from redroll.shared.codec import ValidationError
from redroll.shared.types import GenerationRequest

EOS = 256
"""The end-of-sequence token: a sample that has spelled its whole prompt ends with it (``stop``)."""


class ByteLevelText:
    """UTF-8 bytes as token ids 0..255 and ``EOS``; a chat renders as ``role: content`` lines."""

    chat_template = "{role}: {content}\n ... assistant:"

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(t for t in ids if t < 256).decode(errors="replace")

    def apply_chat_template(self, conversation: list[dict[str, Any]], **_: Any) -> list[int]:
        lines = [f"{m['role']}: {m.get('content') or ''}" for m in conversation]
        return self.encode("\n".join([*lines, "assistant:"]))


class ExampleEngine:
    capabilities = EngineCapabilities(partial_output=True, tokenizer=True)

    def __init__(self, *, capacity: int = 4, token_ms: float = 5.0, weight_version: str = "0") -> None:
        self.capacity = capacity
        self.token_ms = token_ms
        self.tokenizer = ByteLevelText()
        self.info = EngineInfo(name="example", model="example", vocab_size=EOS + 1, eos_token_id=EOS,
                               weight_version=weight_version, logprob_mode="the one choice it has: log 1 = 0")
        self._batch = asyncio.Semaphore(capacity)
        self._made: dict[str, list[int]] = {}  # handle → what its first sample made so far
        self._aborted: set[str] = set()

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        self._aborted.update(self._made)

    def validate(self, request: GenerationRequest) -> None:
        check_token_ids(request, self.info.vocab_size, None)
        refuse_extras(request, "example")
        if request.n != 1:
            raise ValidationError("sampling_params.n", "the example engine makes one sample")
        if request.sampling_params.stop:
            raise ValidationError("sampling_params.stop", "the example engine does not apply stop strings")

    def abort(self, handle: str) -> None:
        self._aborted.add(handle)

    def partial(self, handle: str) -> SampleOutput | None:
        made = self._made.get(handle)
        return SampleOutput(list(made), [0.0] * len(made), None) if made else None

    async def generate(self, request: GenerationRequest, handle: str) -> EngineOutput:
        prompt = self._prompt_ids(request)
        want = request.sampling_params.max_new_tokens
        made: list[int] = []
        finish = "length"
        async with self._batch:
            self._made[handle] = made
            try:
                for token in [*prompt, EOS][:want]:
                    if handle in self._aborted:
                        finish = "abort"
                        break
                    await asyncio.sleep(self.token_ms / 1000)
                    made.append(token)
                    if token == EOS or token in request.sampling_params.stop_token_ids:
                        finish = "stop"
                        break
            finally:
                self._made.pop(handle, None)
                self._aborted.discard(handle)
        sample = SampleOutput(made, [0.0] * len(made) if request.return_logprob else None, finish)
        output = EngineOutput(samples=[sample], prompt_tokens=len(prompt), weight_version=self.info.weight_version,
                              prompt_token_ids=prompt)
        return add_text(output, request, self.tokenizer)

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        if request.input_ids is not None:
            return list(request.input_ids)
        if request.messages is not None:
            return render_chat(self.tokenizer, request, "example")
        return self.tokenizer.encode(request.prompt or "")
