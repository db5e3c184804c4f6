"""A stand-in for sglang 0.5.23's offline ``sglang.Engine``, to test the redroll adapter without a GPU.

It reproduces the *contract* the adapter depends on — call signatures, output shapes, finish
reasons, exceptions and their messages, the abort dedup and its races, signal handlers, shutdown,
memory bookkeeping — not the model. It is split like the SGLang modules it imitates, each
citing the 0.5.23 file and lines (paths under ``sglang/srt/`` of the wheel):

* :mod:`.io_struct` — managers/io_struct.py (request classes and fields);
* :mod:`.schedule_batch` — managers/schedule_batch.py (finish reasons, ``update_finish_state``);
* :mod:`.scheduler` — managers/scheduler.py and scheduler_components/weight_updater.py;
* :mod:`.tokenizer_manager` — managers/tokenizer_manager.py (the in-process part);
* :mod:`.server_args` — server_args.py and arg_groups/ (unknown keywords, sealing, LoRA resolution);
* :mod:`.engine` — entrypoints/engine.py (``Engine``).

The contract tests (``tests/test_sglang_contract.py``) check the names both the adapter and this
stand-in rely on against the real wheel.

Simplifications (not part of the adapter's contract): a byte-level toy tokenizer; deterministic
tokens and logprobs instead of a model; a toy prefix cache for ``cached_tokens``; one tick of the
scheduler loop is one forward pass for every running request; the scheduler runs as a task in
the same loop; a scheduler crash raises :class:`SchedulerCrash` instead of killing the process;
``kill_process_tree`` only records unless ``kill_for_real``; multimodal and batch inputs are not
modelled.
"""

from .engine import Engine, StandInOptions
from .io_struct import (
    AbortReq,
    ContinueGenerationReqInput,
    GenerateReqInput,
    PauseGenerationReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    UpdateWeightFromDiskReqInput,
)
from .schedule_batch import FINISH_ABORT, FINISH_LENGTH, FINISH_MATCHED_STR, FINISH_MATCHED_TOKEN
from .scheduler import SchedulerCrash, StandInScheduler, default_token_fn, token_logprob, weight_version_spans
from .server_args import ServerArgs
from .tokenizer_manager import HTTPException, ReqState, StandInTokenizer, TokenizerManager

__version__ = "0.5.23"

__all__ = [
    "FINISH_ABORT", "FINISH_LENGTH", "FINISH_MATCHED_STR", "FINISH_MATCHED_TOKEN", "AbortReq",
    "ContinueGenerationReqInput", "Engine", "GenerateReqInput", "HTTPException", "PauseGenerationReqInput",
    "ReleaseMemoryOccupationReqInput", "ReqState", "ResumeMemoryOccupationReqInput", "SchedulerCrash",
    "ServerArgs", "StandInOptions", "StandInScheduler", "StandInTokenizer", "TokenizerManager",
    "UpdateWeightFromDiskReqInput", "__version__", "default_token_fn", "token_logprob", "weight_version_spans",
]
