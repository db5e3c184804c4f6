"""The wire contract of redroll: types, codec, key names, settings, connection and Lua scripts.

Nothing here imports an engine, torch or transformers.
"""

from .codec import (
    SCHEMA_VERSION,
    ValidationError,
    decode_record,
    decode_request,
    encode_record,
    encode_request,
)
from .keys import Keys
from .settings import Settings
from .types import CompletionRecord, GenerationRequest, RecordStatus, SamplingParams

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
