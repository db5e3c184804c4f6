"""Control-stream commands as one tagged union (the ``kind`` key names the member).

An entry of ``{ns}:control`` has plain ``kind`` and ``target`` fields (for ``redis-cli``) and a
msgpack ``data`` map: one of the Structs below, tagged by ``kind``. Workers read it with plain
XREAD; a kind they do not know (from a newer producer) is skipped.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Mapping, Optional, Union

import msgspec

from redroll.shared.types import RequestId


class Command(msgspec.Struct, tag_field="kind", kw_only=True):
    target: Optional[str] = None
    """A worker name, or None for every worker."""
    sent_at: float = msgspec.field(default_factory=time.time)

    @property
    def kind(self) -> str:
        return self.__struct_config__.tag  # type: ignore[return-value]


class Abort(Command, tag="abort"):
    request_ids: list[RequestId] = []
    group_ids: list[RequestId] = []


class Drain(Command, tag="drain"):
    pass


UpdateMode = Literal["quiesce", "abort", "in_place"]
"""How a worker takes new weights: ``quiesce`` stops claiming and lets in-flight work finish first;
``abort`` aborts it (partial output kept with collect_unfinished); ``in_place`` pauses generation
between two decode steps, swaps, and continues (the tokens after the swap attend to KV computed with
the old weights; every token's version is in the record)."""


class UpdateWeights(Command, tag="update_weights"):
    model_path: str
    weight_version: Optional[str] = None
    abort_inflight: bool = False
    mode: Optional[UpdateMode] = None
    """None: ``abort`` when ``abort_inflight``, else ``quiesce``."""

    @property
    def effective_mode(self) -> UpdateMode:
        return self.mode or ("abort" if self.abort_inflight else "quiesce")


class TensorSpec(msgspec.Struct, array_like=True):
    name: str
    dtype: str
    shape: list[int]


class SyncWeights(Command, tag="sync_weights"):
    """A trainer's push, attempt ``attempt``: the named workers join the group (trainer rank 0, each
    worker from its rank offset), receive ``tensors`` in this order into staging, report, and swap
    only on :class:`SyncCommit` (a failed attempt is :class:`SyncAbort`-ed, its staging dropped)."""

    sync_id: str
    attempt: int
    version: str
    group_name: str
    master_address: str
    master_port: int
    world_size: int
    backend: str
    ranks: dict[str, int]
    """worker name → its first rank (a tensor-parallel engine takes tp_size ranks from there)."""
    tensors: list[TensorSpec]
    mode: UpdateMode = "in_place"
    timeout_s: float = 60.0
    checkpoint_path: Optional[str] = None
    """Where these weights are also on disk (late joiners load them from there), if anywhere."""


class SyncCommit(Command, tag="sync_commit"):
    sync_id: str
    attempt: int
    version: str


class SyncAbort(Command, tag="sync_abort"):
    sync_id: str
    attempt: int
    reason: str = ""


class ReleaseMemory(Command, tag="release_memory"):
    pass


PauseMode = Literal["keep", "wait", "abort"]
"""How a paused worker treats what it runs (vLLM's ``/pause`` modes): ``keep`` lets it run on (and a
weight update meanwhile swaps in place); ``wait`` reports paused once it finished; ``abort`` aborts
it (partial output kept with collect_unfinished). Queued requests wait in every mode."""


class Pause(Command, tag="pause"):
    """Stop claiming until :class:`Resume` (the fleet's pause; ``{ns}:weights`` field ``paused``
    tells workers that start meanwhile)."""

    mode: PauseMode = "keep"


class Resume(Command, tag="resume"):
    pass


class ResumeMemory(Command, tag="resume_memory"):
    pass


class CommandFailed(Command, tag="command_failed"):
    """A worker's report that it refused or failed a command (``redroll weights`` prints it)."""

    worker: str
    command: str
    error: str


ControlCommand = Union[Abort, Drain, UpdateWeights, ReleaseMemory, ResumeMemory, CommandFailed, SyncWeights,
                       SyncCommit, SyncAbort, Pause, Resume]
ENGINE_COMMANDS = (UpdateWeights, ReleaseMemory, ResumeMemory, Pause, Resume)
SYNC_COMMANDS = (SyncWeights, SyncCommit, SyncAbort)

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(ControlCommand)


def command_fields(cmd: Command) -> dict[str, bytes]:
    return {"kind": cmd.kind.encode(), "target": (cmd.target or "*").encode(), "data": _ENCODER.encode(cmd)}


def parse_command(fields: Mapping[Any, Any]) -> Command | None:
    """The command of a control entry, or None (not one this version knows, or invalid)."""
    data = fields.get(b"data", fields.get("data"))
    if not isinstance(data, (bytes, bytearray)):
        return None
    try:
        return _DECODER.decode(data)
    except msgspec.DecodeError:  # (ValidationError included: an unknown kind, a bad field)
        return None
