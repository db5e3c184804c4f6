"""Every name of sglang that the SGLang adapter relies on, for the pinned release.

The adapter (:mod:`.sglang_engine`) reads, calls and passes only what is listed here; the contract
tests (``tests/test_sglang_contract.py``) check each entry against the source of the pinned wheel
(``pip download --no-deps sglang==<SGLANG_VERSION>``), so a renamed field fails there, not on a
user's fleet. Paths are under ``sglang/srt/`` of the wheel; lines are those of 0.5.23.
"""

from __future__ import annotations

SGLANG_VERSION = "0.5.23"
"""The one release the adapter is tested against (pyproject's ``sglang`` extra and the
Dockerfile pin exactly this; a test checks that the three agree)."""

SERVER_ARGS_FIELDS = (
    # arg_groups/fields/*.py (0.5.23 composes ServerArgs from these namespaces, server_args.py:522-563)
    "model_path", "tp_size", "dp_size", "mem_fraction_static", "max_running_requests", "context_length",
    "dtype", "random_seed", "enable_memory_saver", "skip_tokenizer_init", "weight_version", "log_level",
    "enable_lora", "lora_paths", "enable_deterministic_inference", "load_format", "enable_return_routed_experts",
)
"""``ServerArgs`` fields the worker passes to ``sglang.Engine(**kwargs)`` or reads back."""

ASYNC_GENERATE_PARAMS = (
    # entrypoints/engine.py:545-601
    "prompt", "input_ids", "sampling_params", "return_logprob", "lora_path", "rid", "stream",
    "top_logprobs_num", "logprob_start_len", "return_routed_experts",
)
"""Keyword parameters of ``Engine.async_generate`` the adapter passes."""

ENGINE_METHODS = {
    # entrypoints/engine.py
    "async_generate": (),
    "get_all_child_pids": (),  # :398-400
    "shutdown": (),  # :1450-1497 (not called: it blocks and kills every child, see close())
}

TOKENIZER_MANAGER_METHODS = {
    # managers/tokenizer_manager.py
    "abort_request": ("rid", "abort_all"),  # :2241-2265
    "auto_create_handle_loop": (),  # :2440-2463
    "update_weights_from_disk": ("obj", "request"),  # :2288-2322
    "pause_generation": ("obj",),  # :2267-2280 (no Engine wrapper; the server awaits it, http_server.py:1831-1841)
    "continue_generation": ("obj",),  # :2282-2286
    # managers/tokenizer_control_mixin.py (weight sync; each asserts dp_size == 1: :451, :464, :509, :569)
    "init_weights_update_group": ("obj", "request"),  # :445-456
    "destroy_weights_update_group": ("obj", "request"),  # :458-469
    "begin_weight_update": ("obj", "request"),  # :485-492
    "end_weight_update": ("obj", "request"),  # :494-501
    "update_weights_from_distributed": ("obj", "request"),  # :503-533
    "update_weights_from_tensor": ("obj", "request"),  # :563-596
    "flush_cache": ("timeout_s",),  # :325-334
    "release_memory_occupation": ("obj", "request"),  # tokenizer_control_mixin.py:874-880
    "resume_memory_occupation": ("obj", "request"),  # tokenizer_control_mixin.py:882-888
}

TOKENIZER_MANAGER_ATTRIBUTES = (
    # managers/tokenizer_manager.py
    "rid_to_state",  # :710
    "asyncio_tasks",  # :713
    "model_config",
    "tokenizer",
    "context_len",  # :600
    "max_req_input_len",  # :602 (set by engine.py:1355-1357)
    "num_reserved_tokens",  # :605
    "enable_lora",  # :544 (the resolved value; server_args.enable_lora stays None with only lora_paths)
    "incremental_streaming_output",  # :543 (streamed chunks are deltas, else the live cumulative lists)
    "server_args",
    "_subprocess_watchdog",
)

REQ_STATE_FIELDS = ("dispatched", "abort_sent")
"""managers/tokenizer_manager.py ``ReqState`` :281-282."""

IO_STRUCT_FIELDS = {
    # managers/io_struct.py
    "UpdateWeightFromDiskReqInput": ("model_path", "load_format", "weight_version", "flush_cache"),  # :1970-1992
    "InitWeightsUpdateGroupReqInput": ("master_address", "master_port", "rank_offset", "world_size", "group_name",
                                       "backend"),  # :2126-2138
    "DestroyWeightsUpdateGroupReqInput": ("group_name",),  # :2146-2147
    "UpdateWeightsFromDistributedReqInput": ("names", "dtypes", "shapes", "group_name", "flush_cache",
                                             "weight_version"),  # :2002-2019
    "UpdateWeightsFromTensorReqInput": ("serialized_named_tensors", "flush_cache", "weight_version"),  # :2027-2047
    "BeginWeightUpdateReqInput": (),  # :2197-2200
    "EndWeightUpdateReqInput": (),  # :2208-2209
    "PauseGenerationReqInput": ("mode",),  # :1927-1946
    "ContinueGenerationReqInput": (),  # :1949-1955
    "FlushCacheReqOutput": ("success",),  # :1859-1861
    "ReleaseMemoryOccupationReqInput": ("tags",),  # :2177-2180
    "ResumeMemoryOccupationReqInput": ("tags",),  # :2187-2190
}

SAMPLING_PARAMS_SOURCE = "sampling/sampling_params.py"
"""Every sampling key redroll forwards (``redroll.shared.types``) must be a field of
``SamplingParams`` there (:140-181)."""

FINISH_REASON_TYPES = {
    # managers/schedule_batch.py:279-345: class -> its to_json() "type"
    "FINISH_MATCHED_TOKEN": "stop",
    "FINISH_MATCHED_STR": "stop",
    "FINISH_LENGTH": "length",
    "FINISH_ABORT": "abort",
}

OUTPUT_KEYS = ("text", "output_ids", "meta_info")
"""The keys of ``async_generate``'s output dict the adapter reads (managers/tokenizer_manager.py
:308-310; ``text`` with stop strings trimmed by detokenizer_manager.py ``trim_matched_stop`` :194-212)."""

META_INFO_KEYS = (
    # managers/tokenizer_manager.py _handle_batch_output :2507-2559, :2753; add_logprob_to_meta_info :2868
    "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
    "output_token_logprobs", "e2e_latency", "num_retractions",
    "output_top_logprobs", "input_token_logprobs", "routed_experts",  # :2973, :2868, :2602-2609
)

UTILS_CLASSES = {
    # utils/common.py (re-exported by sglang.srt.utils, utils/__init__.py:2)
    "MultiprocessingSerializer": ("serialize",),  # :3060-3082
}

WEIGHT_VERSION_KEYS = ("weight_versions", "version", "start", "end")
"""utils/weight_versions.py:90-107: ``meta_info["weight_versions"]``, a list of ``{"version",
"start", "end"}`` spans over the output tokens."""

PAUSE_MODES = ("in_place", "retract")
"""The pause modes the scheduler accepts (scheduler.py:5818)."""

CONSTANTS = {
    # constants.py:2-4 (memory tags)
    "GPU_MEMORY_TYPE_KV_CACHE": "kv_cache",
    "GPU_MEMORY_TYPE_WEIGHTS": "weights",
    "GPU_MEMORY_TYPE_CUDA_GRAPH": "cuda_graph",
}

MEMORY_TAGS = tuple(CONSTANTS.values())
