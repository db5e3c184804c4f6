"""Callback handlers used by tests that run consumers as subprocesses."""

from __future__ import annotations

import json
import os

from redroll.shared.types import CompletionRecord


def append_to_file(record: CompletionRecord) -> None:
    """Append one JSON line per application to $REDROLL_TEST_APPLIED (O_APPEND: atomic per line)."""
    path = os.environ["REDROLL_TEST_APPLIED"]
    line = json.dumps({
        "request_id": record.request_id,
        "status": record.status.value,
        "pid": os.getpid(),
        "ids": record.output_token_ids,
        "logprobs": record.output_logprobs,
        "finish_reasons": record.finish_reasons,
        "meta_info": record.meta_info,
    }) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def always_fail(record: CompletionRecord) -> None:
    raise RuntimeError(f"handler refuses {record.request_id}")
