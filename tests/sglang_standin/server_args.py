"""``sglang/srt/server_args.py`` (0.5.23) as far as the adapter meets it.

* ``ServerArgs(**kwargs)`` refuses an unknown keyword with a TypeError (msgspec Struct,
  server_args.py:551-563) and needs ``model_path``.
* Resolution does not write back into the fields (arg_groups/overrides.py:110-135): with only
  ``lora_paths`` given, ``enable_lora`` stays None (arg_groups/lora_hook.py:38-41); the resolved
  value lives elsewhere (``TokenizerManager.enable_lora``, tokenizer_manager.py:544).
* After the engine launched it is sealed: assigning a field raises AttributeError
  (server_args.py:474-496).
"""

from __future__ import annotations

from typing import Any, Dict

DEFAULTS: Dict[str, Any] = {
    # arg_groups/fields/*.py (file:line of each in the contract tests)
    "model_path": None, "tp_size": 1, "dp_size": 1, "mem_fraction_static": None, "max_running_requests": None,
    "max_queued_requests": None, "context_length": None, "dtype": "auto", "random_seed": None,
    "enable_memory_saver": False, "skip_tokenizer_init": False, "weight_version": "default",
    "load_format": "auto", "enable_lora": None, "lora_paths": None, "log_level": "info",
    "enable_deterministic_inference": False, "schedule_policy": "fcfs", "chunked_prefill_size": None,
    "stream_interval": 1, "incremental_streaming_output": False, "enable_return_routed_experts": False,
    "speculative_algorithm": None,
}


class ServerArgs:
    def __init__(self, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(DEFAULTS))
        if unknown:
            raise TypeError(f"Unexpected keyword argument '{unknown[0]}'")
        if kwargs.get("model_path") is None:
            raise TypeError("Missing required argument 'model_path'")
        object.__setattr__(self, "_resolution_finished", False)
        for name, default in DEFAULTS.items():
            object.__setattr__(self, name, kwargs.get(name, default))

    def seal(self) -> None:
        """What ``resolve_once`` leaves behind (server_args.py:300)."""
        object.__setattr__(self, "_resolution_finished", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_") and self._resolution_finished:
            raise AttributeError(f"server_args.{name} assigned after resolution; server_args is read-only -- use "
                                 "get_context().override(source, ...) to change it")
        object.__setattr__(self, name, value)

    def resolved_enable_lora(self) -> bool:
        """server_args.py:287-289: LoRA is on when asked for, or when adapters are given."""
        return bool(self.enable_lora) or (self.enable_lora is None and bool(self.lora_paths))

    def as_dict(self) -> Dict[str, Any]:
        return {name: getattr(self, name) for name in DEFAULTS}
