"""What an SGLang engine refuses before it runs a request (a mixin of
:class:`.sglang_engine.SGLangEngine`): what SGLang itself would refuse, said here so the request is
dead-lettered at once, naming the field, instead of retried. References are to files under
``sglang/srt/`` of sglang 0.5.23, as in :mod:`.sglang_engine`."""

from __future__ import annotations

from typing import Any

from redroll.engine_worker.engines.base import EngineInfo
from redroll.engine_worker.engines.checks import check_token_ids, refuse_text, refuse_tool_choice
from redroll.engine_worker.engines.text import render_chat
from redroll.shared.codec import ValidationError
from redroll.shared.types import GenerationRequest

ENGINE_NAME = "sglang"


class SGLangChecks:
    """Mixin: needs the attributes :class:`.sglang_engine.SGLangEngine` sets in ``__init__`` and ``start``."""

    engine: Any
    info: EngineInfo
    tokenizer: Any
    skip_tokenizer_init: bool
    max_routed_experts_bytes: int
    _lora_enabled: bool
    _reserved_tokens: int
    _max_req_input_len: int | None
    _routed_shape: tuple[int, int] | None

    def validate(self, request: GenerationRequest) -> None:
        """Refuse what SGLang would refuse, so it is dead-lettered at once instead of retried."""
        check_token_ids(request, self.info.vocab_size, None)
        refuse_tool_choice(request, ENGINE_NAME)
        if request.prefix_ids is not None:
            raise ValidationError("prefix_ids", "the sglang engine does not render a session's new part yet: send the "
                                                "whole prompt")
        if request.prompt is not None and request.input_ids is None and self._started_without_tokenizer():
            # tokenizer_manager.py _tokenize_one_request: "The engine initialized with
            # skip_tokenizer_init=True cannot accept text prompts."
            raise ValidationError("prompt", "this SGLang engine runs with skip_tokenizer_init: send input_ids")
        if self._started_without_tokenizer():
            refuse_text(request, ENGINE_NAME, None)
        if request.lora_path is not None and self.engine is not None and not self._lora_enabled:
            # tokenizer_manager.py:3729-3736 (ValueError "LoRA is not enabled")
            raise ValidationError("lora_path", "LoRA is not enabled on this SGLang engine (start it with lora_paths)")
        prompt_len = self._prompt_len(request)
        if request.return_routed_experts:
            self._check_routed_experts(request, prompt_len)
        if prompt_len is None:
            return
        context = self.info.max_context
        max_new = request.sampling_params.max_new_tokens
        field_name = "input_ids" if request.input_ids is not None else "prompt" if request.prompt else "messages"
        counted = prompt_len + self._reserved_tokens  # tokenizer_manager.py:1334-1335
        if context is not None and counted >= context:  # :1338
            raise ValidationError(field_name, f"the input ({counted} tokens) is longer than the model's "
                                              f"context length ({context} tokens)")
        if context is not None and counted + max_new > context:  # :1354-1358 (">": equal is accepted)
            raise ValidationError("sampling_params.max_new_tokens",
                                  f"prompt ({counted}) + max_new_tokens ({max_new}) exceeds the model's "
                                  f"context length of {context} tokens")
        # managers/utils.py:272 validate_input_length (scheduler): a 400 abort otherwise.
        if self._max_req_input_len is not None and prompt_len >= self._max_req_input_len:
            raise ValidationError(field_name, f"input length ({prompt_len} tokens) exceeds the engine's maximum "
                                              f"allowed length ({self._max_req_input_len} tokens)")

    def _check_routed_experts(self, request: GenerationRequest, prompt_len: int | None) -> None:
        """Routed experts travel in the record as raw int32 ``[tokens, layers, top_k]`` per sample,
        over prompt and output (``seqlen - 1`` tokens: layers/state_capturer/base.py:183-188), e.g.
        about 50 MB for 32k tokens x 48 layers x 8. A request whose worst case, ``(prompt +
        max_new_tokens - 1) x layers x top_k x 4 bytes x n``, exceeds ``max_routed_experts_bytes``
        is refused here, so no record outgrows what a stream entry should carry."""
        if self.engine is not None and self._routed_shape is None:
            raise ValidationError("return_routed_experts", "this SGLang engine does not return routed experts: start "
                                                           "it with --sglang-arg enable_return_routed_experts=true "
                                                           "on an MoE model")
        if self._routed_shape is None or prompt_len is None:
            return
        layers, top_k = self._routed_shape
        tokens = prompt_len + request.sampling_params.max_new_tokens - 1
        size = tokens * layers * top_k * 4 * request.n
        if size > self.max_routed_experts_bytes:
            raise ValidationError("return_routed_experts",
                                  f"the routed experts could take {size} bytes ({tokens} tokens x {layers} layers x "
                                  f"{top_k} experts x 4 bytes x n={request.n}), over this worker's "
                                  f"max_routed_experts_bytes of {self.max_routed_experts_bytes}; ask for fewer "
                                  "tokens or raise the limit (--max-routed-experts-bytes)")

    def effective_max_new_tokens(self, prompt_len: int, requested: int) -> int:
        """What SGLang's scheduler will really allow: ``min(requested, max_req_len - input - 1)``
        (scheduler.py:2710; ``max_req_len = max_req_input_len + 5``, tp_worker.py:568-572). Its KV
        memory cap (scheduler.py:2723, per batch) cannot be known here."""
        if self._max_req_input_len is None:
            return requested
        return max(0, min(requested, self._max_req_input_len + 5 - prompt_len - 1))

    def _started_without_tokenizer(self) -> bool:
        return self.skip_tokenizer_init or (self.engine is not None and self.tokenizer is None)

    def _prompt_len(self, request: GenerationRequest) -> int | None:
        if request.input_ids is not None:
            return len(request.input_ids)
        if request.messages is not None and self.tokenizer is not None:
            return len(render_chat(self.tokenizer, request, ENGINE_NAME))  # (refuses a chat it cannot render)
        if request.prompt is not None and self.tokenizer is not None:
            try:
                return len(self.tokenizer.encode(request.prompt))
            except Exception:  # a tokenizer quirk must not turn into a dead letter
                return None
        return None
