"""Ready-made callback handlers for ``redroll consume --handler NAME=redroll.handlers:FUNCTION``."""

from __future__ import annotations

import json
import os
import sys

from redroll.shared.types import CompletionRecord


def print_record(record: CompletionRecord) -> None:
    """One line per record on stdout: request_id, status, tokens per sample."""
    lengths = ",".join(str(len(s)) for s in record.output_token_ids)
    print(f"{record.request_id} {record.status.value} finish={record.finish_reasons} tokens={lengths}"
          + (f" error={record.error}" if record.error else ""), flush=True)


def append_jsonl(record: CompletionRecord) -> None:
    """Append the record as one JSON line to $REDROLL_OUT (default redroll-records.jsonl)."""
    path = os.environ.get("REDROLL_OUT", "redroll-records.jsonl")
    line = json.dumps({
        "request_id": record.request_id, "status": record.status.value, "worker": record.worker,
        "output_token_ids": record.output_token_ids, "finish_reasons": record.finish_reasons,
        "output_logprobs": record.output_logprobs, "meta_info": record.meta_info, "error": record.error,
        "group_id": record.group_id, "output_text": record.output_text,
    }, default=str)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")


if __name__ == "__main__":
    print("handlers: print_record, append_jsonl", file=sys.stderr)
