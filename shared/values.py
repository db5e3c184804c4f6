"""Parsers of setting values, for flags and ``REDROLL_*`` variables alike: one rule each, said in
one line naming what is wrong (argparse shows it after the flag; a variable's reader after its name)."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any, Callable, Sequence


def whole_number(least: int, name: str) -> Callable[[str], int]:
    """A parser of whole numbers of at least ``least``, called ``name`` (argparse's help shows it)."""
    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{raw!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is not positive" if least == 1 else f"{value} is less than {least}")
        return value

    parse.__name__ = name
    return parse


def amount(unit: str, name: str, *, above: float | None = None, at_least: float | None = None,
           at_most: float | None = None) -> Callable[[str], float]:
    """A parser of finite numbers of ``unit`` (seconds, GiB; '' for a plain number) in the range
    given, called ``name``."""
    what = f"a number of {unit}" if unit else "a number"
    suffix = f" {unit}" if unit else ""

    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{raw!r} is not {what}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{raw!r} is not {what}")
        if above is not None and not value > above:
            raise argparse.ArgumentTypeError(f"must be more than {above:g}{suffix}, got {raw}")
        if at_least is not None and value < at_least:
            raise argparse.ArgumentTypeError(f"must be {at_least:g}{suffix} or more, got {raw}")
        if at_most is not None and value > at_most:
            raise argparse.ArgumentTypeError(f"must be at most {at_most:g}{suffix}, got {raw}")
        return value

    parse.__name__ = name
    return parse


positive_int = whole_number(1, "positive_int")
non_negative_int = whole_number(0, "non_negative_int")
number_of_seconds = amount("seconds", "number_of_seconds")
positive_seconds = amount("seconds", "positive_seconds", above=0)
seconds_from_zero = amount("seconds", "seconds_from_zero", at_least=0)
positive_gib = amount("GiB", "positive_gib", above=0)
fraction = amount("", "fraction", above=0, at_most=1)
"""A share of something, in (0, 1]."""


def key_values(pairs: Sequence[str], flag: str, form: str = "KEY=VALUE", *,
               key: Callable[[str], str] = lambda k: k) -> dict[str, Any]:
    """``["a=1", "b=true", "c=x"]`` → ``{"a": 1, "b": True, "c": "x"}``: each VALUE parsed as JSON
    when it can be, else kept as text; ``key`` normalizes each key. A pair without ``=`` or a key
    is refused naming ``flag`` and the ``form`` it must have."""
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"{flag} {pair!r} must look like {form}")
        try:
            out[key(name)] = json.loads(raw)
        except ValueError:
            out[key(name)] = raw
    return out
