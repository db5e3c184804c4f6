"""``sglang/srt/managers/io_struct.py`` (0.5.23): the request objects the adapter builds or meets.

Same class and field names, so the adapter builds them from this module exactly as from the real
one (the contract tests check the real names). Only the fields the stand-in models are present.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional, Union


@dataclass
class BaseReq:
    """io_struct.py:86-90 (``rid``, ``http_worker_ipc``; every request class is kw_only)."""

    rid: Optional[Union[str, List[str]]] = field(default=None, kw_only=True)
    http_worker_ipc: Optional[str] = field(default=None, kw_only=True)

    def regenerate_rid(self):
        """A fresh ``uuid4().hex`` (what ``_handle_batch_request`` gives each parallel sample)."""
        if isinstance(self.rid, list):
            self.rid = [uuid.uuid4().hex for _ in range(len(self.rid))]
        else:
            self.rid = uuid.uuid4().hex
        return self.rid


@dataclass
class GenerateReqInput(BaseReq):
    """The fields of ``GenerateReqInput`` that the stand-in models."""

    text: Optional[Union[List[str], str]] = None
    input_ids: Optional[Union[List[List[int]], List[int]]] = None
    sampling_params: Optional[Union[List[Dict], Dict]] = None
    return_logprob: Optional[Union[List[bool], bool]] = None
    logprob_start_len: Optional[Union[List[int], int]] = None
    top_logprobs_num: Optional[Union[List[int], int]] = None
    token_ids_logprob: Optional[Union[List[List[int]], List[int]]] = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    lora_path: Optional[Union[List[Optional[str]], Optional[str]]] = None
    custom_logit_processor: Optional[Union[List[Optional[str]], str]] = None
    data_parallel_rank: Optional[int] = None
    return_routed_experts: bool = False

    def normalize_batch_and_arguments(self) -> None:
        """``normalize_batch_and_arguments`` for single text / single input_ids inputs: ``n > 1``
        turns a single request into a batch (``_handle_parallel_sampling``); a string rid ``X``
        becomes ``X_0 .. X_{k-1}`` (``_normalize_rid``); a missing rid is ``uuid4().hex`` (:563-564)."""
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("Either text, input_ids or input_embeds should be provided.")
        if self.input_ids is not None and len(self.input_ids) == 0:
            raise ValueError("input_ids cannot be empty.")
        if isinstance(self.text, list) or (self.input_ids is not None and not isinstance(self.input_ids[0], int)):
            raise NotImplementedError("stand-in: batch (list) inputs are not modelled")
        self.is_single = True
        self.batch_size = 1
        self.parallel_sample_num = 1 if self.sampling_params is None else self.sampling_params.get("n", 1)
        if self.parallel_sample_num > 1:
            self.is_single = False
            if self.text is not None:
                self.text = [self.text]
            if self.input_ids is not None:
                self.input_ids = [self.input_ids]
        if self.is_single:
            if self.sampling_params is None:
                self.sampling_params = {}
            if self.rid is None:
                self.rid = uuid.uuid4().hex
            if self.return_logprob is None:
                self.return_logprob = False
            if self.logprob_start_len is None:
                self.logprob_start_len = -1
            if self.top_logprobs_num is None:
                self.top_logprobs_num = 0
        else:
            num = self.batch_size * self.parallel_sample_num
            if self.text is not None:
                self.text = self.text * self.parallel_sample_num
            if self.input_ids is not None:
                self.input_ids = self.input_ids * self.parallel_sample_num
            if self.rid is None:
                self.rid = [uuid.uuid4().hex for _ in range(num)]
            elif isinstance(self.rid, str):
                self.rid = [f"{self.rid}_{i}" for i in range(num)]
            self.sampling_params = [self.sampling_params] * num
            self.return_logprob = [bool(self.return_logprob)] * num
            self.lora_path = [self.lora_path] * num

    def __getitem__(self, i: int) -> "GenerateReqInput":
        return GenerateReqInput(
            text=self.text[i] if self.text is not None else None,
            input_ids=self.input_ids[i] if self.input_ids is not None else None,
            sampling_params=self.sampling_params[i], rid=self.rid[i], return_logprob=self.return_logprob[i],
            logprob_start_len=-1, top_logprobs_num=0, stream=self.stream,
            lora_path=self.lora_path[i] if self.lora_path is not None else None)


@dataclass
class UpdateWeightFromDiskReqInput(BaseReq):
    """io_struct.py:1970-1992."""

    model_path: str
    load_format: Optional[str] = None
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: Optional[Any] = None


@dataclass
class ReleaseMemoryOccupationReqInput(BaseReq):
    """io_struct.py:2177-2180: None or [] means every tag."""

    tags: Optional[List[str]] = None


@dataclass
class ResumeMemoryOccupationReqInput(BaseReq):
    """io_struct.py:2187-2190."""

    tags: Optional[List[str]] = None


@dataclass
class AbortReq(BaseReq):
    """io_struct.py:2285-2296 (``rid=None`` becomes ``""``)."""

    abort_all: bool = False
    finished_reason: Optional[Dict[str, Any]] = None
    abort_message: Optional[str] = None
    weight_versions: Optional[Any] = None

    def __post_init__(self) -> None:
        if self.rid is None:
            self.rid = ""


@dataclass
class PauseGenerationReqInput(BaseReq):
    """io_struct.py:1927-1946 (the scheduler accepts only in_place / retract, scheduler.py:5818)."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


@dataclass
class ContinueGenerationReqInput(BaseReq):
    """io_struct.py:1949-1955."""

    torch_empty_cache: bool = True


@dataclass
class InitWeightsUpdateGroupReqInput(BaseReq):
    """io_struct.py:2126-2138."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


@dataclass
class DestroyWeightsUpdateGroupReqInput(BaseReq):
    """io_struct.py:2146-2147."""

    group_name: str = "weight_update_group"


@dataclass
class UpdateWeightsFromDistributedReqInput(BaseReq):
    """io_struct.py:2002-2019."""

    names: List[str]
    dtypes: List[str]
    shapes: List[List[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    load_format: Optional[str] = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


@dataclass
class UpdateWeightsFromTensorReqInput(BaseReq):
    """io_struct.py:2027-2047 (one serialized payload per TP rank)."""

    serialized_named_tensors: List[Union[str, bytes]]
    load_format: Optional[str] = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


@dataclass
class BeginWeightUpdateReqInput(BaseReq):
    """io_struct.py:2197-2200."""

    selector: Literal["target", "draft", "all"] = "all"


@dataclass
class EndWeightUpdateReqInput(BaseReq):
    """io_struct.py:2208-2209."""


@dataclass
class UpdateWeightVersionReqInput(BaseReq):
    """io_struct.py:2155-2159."""

    new_version: str
    abort_all_requests: bool = True


@dataclass
class FlushCacheReqOutput:
    """io_struct.py:1859-1861 (what ``flush_cache`` answers)."""

    success: bool
    message: str = ""
