"""How a payload that breaks the wire contract is refused: :class:`ValidationError` naming the
field and the rule, msgspec's own errors said that way, and the stream-field envelope's readers
(shared by the request codec, :mod:`.codec`, and the record codec, :mod:`.record_codec`)."""

from __future__ import annotations

import re
from typing import Any, Mapping

import msgspec

from redroll.shared.errors import RedrollError
from redroll.shared.types import REQUEST_ID_RULE, SCHEMA_VERSION_RULE


class ValidationError(RedrollError, ValueError):
    """A payload broke the wire contract. ``field`` names where, ``rule`` says what."""

    def __init__(self, field: str, rule: str, *, request_id: str | None = None, reply_to: str | None = None):
        super().__init__(f"{field}: {rule}")
        self.field = field
        self.rule = rule
        # Filled in when they could be read, so that a waiter can be told.
        self.request_id = request_id
        self.reply_to = reply_to
        self.callback: str | None = None
        """The handler the request named, when readable (its error record is routed to it)."""

    @property
    def reason(self) -> str:
        return f"invalid {self.field}: {self.rule}"


class NewerSchemaError(ValidationError):
    """The entry was written for a newer schema: hand it back for a newer worker."""


TOO_DEEP = "maps or lists nested too deeply"
"""The rule a payload breaks when msgspec's decoders, which recurse in C, hit Python's recursion
limit (about 1,000 levels): a poison payload, refused like any other invalid one."""

# ---------------------------------------------------------------- msgspec errors → ValidationError

_AT = re.compile(r" - at `\$\.?(.*)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(.*)`$")
_MISSING = re.compile(r"^Object missing required field `(.*)`$")
_GOT = re.compile(r", got `(\w+)`$")
_COLLAPSE = ("sampling_params.stop[", "sampling_params.stop_regex", "sampling_params.logit_bias",
             "sampling_params.custom_params", "meta_info")
"""Paths reported at their field, not deeper (a stop string, a key inside meta_info)."""


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _from_msgspec(exc: msgspec.ValidationError, prefix: str = "") -> ValidationError:
    message = str(exc)
    at = _AT.search(message)
    path = at.group(1) if at else ""
    rule = message[: at.start()] if at else message
    if m := _UNKNOWN.match(rule):
        path = _join(path, m.group(1))
        rule = ("unknown sampling parameter" if path.startswith("sampling_params") or prefix.startswith("sampling_params")
                else "unknown field")
    elif m := _MISSING.match(rule):
        path = _join(path, m.group(1))
        rule = "is required"
    path = prefix + path if path else prefix.rstrip(".")
    # The rule in words, not msgspec's regex or bound (the one pattern is the request_id's).
    if rule.startswith("Expected `str` matching regex") or (path == "request_id" and rule.startswith("Expected")):
        got = _GOT.search(rule)
        rule = REQUEST_ID_RULE + (f", got {got.group(1)}" if got else "")
    elif path == "v" and rule.startswith("Expected"):
        got = _GOT.search(rule)
        rule = SCHEMA_VERSION_RULE + (f", got {got.group(1)}" if got else "")
    for short in _COLLAPSE:
        if path.startswith(short):
            path = short.rstrip("[")
    if re.match(r"^(output_logprobs|weight_versions)\[\d+\]\[", path):
        path = path[: path.index("]") + 1]
    return ValidationError(path or "data", rule)


# ---------------------------------------------------------------- the stream-field envelope


def _field(fields: Mapping[Any, Any], name: str) -> Any:
    raw = fields.get(name.encode())
    return fields.get(name) if raw is None else raw


def _field_str(fields: Mapping[Any, Any], name: str) -> str | None:
    raw = _field(fields, name)
    if isinstance(raw, (bytes, bytearray)):
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return None
    return raw if isinstance(raw, str) else None


def _data(fields: Mapping[Any, Any]) -> bytes:
    data = _field(fields, "data")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValidationError("data", "missing or not bytes")
    return data
