"""The wire contract of redroll: types, codec, key names, settings, connection and Lua scripts.

Nothing here imports an engine, torch or transformers.
"""

from redroll.shared.codec import (
    SCHEMA_VERSION,
    ValidationError,
    decode_record,
    decode_request,
    encode_record,
    encode_request,
)
from redroll.shared.keys import Keys
from redroll.shared.settings import Settings
from redroll.shared.types import CompletionRecord, GenerationRequest, RecordStatus, SamplingParams

__all__ = [
    "SCHEMA_VERSION",
    "CompletionRecord",
    "GenerationRequest",
    "Keys",
    "RecordStatus",
    "SamplingParams",
    "Settings",
    "ValidationError",
    "decode_record",
    "decode_request",
    "encode_record",
    "encode_request",
]
