"""``sglang/srt/managers/schedule_batch.py`` (0.5.23): finish reasons and the request's finish state."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Dict, List, Optional, Union


class BaseFinishReason:
    def __init__(self, is_error: bool = False) -> None:
        self.is_error = is_error


class FINISH_MATCHED_TOKEN(BaseFinishReason):
    """:284: ``{"type": "stop", "matched": <token id>}``."""

    def __init__(self, matched: Union[int, List[int]]) -> None:
        super().__init__()
        self.matched = matched

    def to_json(self) -> dict:
        return {"type": "stop", "matched": self.matched}


class FINISH_MATCHED_STR(BaseFinishReason):
    """:296: ``{"type": "stop", "matched": <str>}``."""

    def __init__(self, matched: str) -> None:
        super().__init__()
        self.matched = matched

    def to_json(self) -> dict:
        return {"type": "stop", "matched": self.matched}


class FINISH_LENGTH(BaseFinishReason):
    """:320: ``{"type": "length", "length": <max_new_tokens in effect>}``."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length

    def to_json(self) -> dict:
        return {"type": "length", "length": self.length}


class FINISH_ABORT(BaseFinishReason):
    """:332-345; a user abort of a running request is ``FINISH_ABORT()`` (status None, scheduler.py:5812)."""

    def __init__(self, message: Optional[str] = None, status_code: Optional[int] = None,
                 err_type: Optional[str] = None) -> None:
        super().__init__(is_error=True)
        self.message = message or "Aborted"
        self.status_code = status_code
        self.err_type = err_type

    def to_json(self) -> dict:
        return {"type": "abort", "message": self.message, "status_code": self.status_code, "err_type": self.err_type}


class Req:
    """``Req`` (the fields the stand-in needs)."""

    def __init__(self, rid: str, input_ids: List[int], sampling_params: Dict[str, Any], return_logprob: bool,
                 lora_path: Optional[str], cached_tokens: int, stream: bool = False) -> None:
        self.rid = rid
        self.origin_input_ids = list(input_ids)
        self.prompt_ids = list(input_ids)
        self.sampling_params = dict(sampling_params)
        self.return_logprob = return_logprob
        self.lora_path = lora_path
        self.cached_tokens = cached_tokens
        self.stream = stream
        self.output_ids: List[int] = []
        self.output_logprobs: List[float] = []
        self.output_versions: List[str] = []
        """The weight version of each output token (the scheduler's version when it was made)."""
        self.finished_reason: Optional[BaseFinishReason] = None
        self.to_finish: Optional[BaseFinishReason] = None
        self.retraction_count = 0
        self.sent_offset = 0
        """Output tokens already streamed to the tokenizer manager."""

    def finished(self) -> bool:
        return self.finished_reason is not None

    def set_finish_with_abort(self, error_msg: str) -> None:
        """:2221-2238 (400, "BadRequestError")."""
        self.origin_input_ids = [0]  # "set it to one token to skip the long prefill"
        self.return_logprob = False
        self.to_finish = FINISH_ABORT(error_msg, HTTPStatus.BAD_REQUEST, "BadRequestError")

    def update_finish_state(self, tokenizer: Any, eos_ids: set) -> None:
        """``Req.update_finish_state`` (:2007-2047), in its order: a pending abort, then a stop
        string, then a stop token / EOS, then the length cap. At the same token a stop string beats
        EOS and EOS beats the length cap."""
        if self.finished():
            return
        if self.to_finish:
            self.finished_reason = self.to_finish
            self.to_finish = None
            return
        sp = self.sampling_params
        max_new = sp.get("max_new_tokens", 128)
        # (min_new_tokens is enforced by a logits penalizer that masks stop tokens, not here:
        # sampling/penaltylib/min_new_tokens.py:89; the scheduler loop masks them for the stand-in)
        stops = sp.get("stop") or ()
        if isinstance(stops, str):
            stops = [stops]
        if stops and tokenizer is not None:
            text = tokenizer.decode(self.output_ids)
            for stop in stops:
                if stop in text:
                    self.finished_reason = FINISH_MATCHED_STR(matched=stop)
                    return
        last = self.output_ids[-1]
        stop_ids = set(sp.get("stop_token_ids") or ())
        if last in stop_ids or (not sp.get("ignore_eos", False) and last in eos_ids):
            self.finished_reason = FINISH_MATCHED_TOKEN(matched=last)
            return
        if len(self.output_ids) >= max_new:
            self.finished_reason = FINISH_LENGTH(length=max_new)
