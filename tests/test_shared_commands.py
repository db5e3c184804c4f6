"""shared.commands: control commands as one tagged union, read back by msgpack too."""

from __future__ import annotations

import msgpack
import pytest

from redroll.shared.commands import (
    Abort,
    CommandFailed,
    Drain,
    ReleaseMemory,
    ResumeMemory,
    UpdateWeights,
    command_fields,
    parse_command,
)


@pytest.mark.parametrize("cmd", [
    Abort(request_ids=["a", "b_1"], group_ids=["g"]), Drain(target="worker-1"),
    UpdateWeights(model_path="/ckpt/3", weight_version="3", abort_inflight=True), ReleaseMemory(), ResumeMemory(),
    CommandFailed(worker="w", command="release_memory", error="EngineCommandRefused: no"),
])
def test_round_trip_and_plain_fields(cmd):
    fields = command_fields(cmd)
    assert fields["kind"] == cmd.kind.encode() and fields["target"] == (cmd.target or "*").encode()
    assert parse_command(fields) == cmd
    plain = msgpack.unpackb(fields["data"], raw=False)  # what an outside reader sees
    assert plain["kind"] == cmd.kind and plain["sent_at"] == cmd.sent_at


def test_unknown_kinds_and_bad_entries_are_skipped():
    assert parse_command({b"data": msgpack.packb({"kind": "from_the_future", "x": 1})}) is None
    assert parse_command({b"data": msgpack.packb({"kind": "abort", "request_ids": ["has space"]})}) is None
    assert parse_command({b"data": msgpack.packb({"kind": "update_weights"})}) is None  # model_path missing
    assert parse_command({b"data": b"\xc1"}) is None and parse_command({}) is None
