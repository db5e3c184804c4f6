"""Control-stream commands as one tagged union (the ``kind`` key names the member).

An entry of ``{ns}:control`` has plain ``kind`` and ``target`` fields (for ``redis-cli``) and a
msgpack ``data`` map: one of the Structs below, tagged by ``kind``. Workers read it with plain
XREAD; a kind they do not know (from a newer producer) is skipped.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Optional, Union

import msgspec

from .types import RequestId


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


class UpdateWeights(Command, tag="update_weights"):
    model_path: str
    weight_version: Optional[str] = None
    abort_inflight: bool = False


class ReleaseMemory(Command, tag="release_memory"):
    pass


class ResumeMemory(Command, tag="resume_memory"):
    pass


class CommandFailed(Command, tag="command_failed"):
    """A worker's report that it refused or failed a command (``redroll weights`` prints it)."""

    worker: str
    command: str
    error: str


ControlCommand = Union[Abort, Drain, UpdateWeights, ReleaseMemory, ResumeMemory, CommandFailed]
ENGINE_COMMANDS = (UpdateWeights, ReleaseMemory, ResumeMemory)

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
