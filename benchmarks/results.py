"""What a section reports: named figures (positive numbers) with units and targets, plus details."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Figure:
    value: float
    unit: str
    target: str | None = None
    met: bool | None = None
    note: str | None = None
    signed: bool = False
    """May legitimately be zero or negative (a difference); every other figure is a positive number."""


@dataclass
class SectionResult:
    name: str
    figures: dict[str, Figure] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    skipped: str | None = None
    wall_s: float = 0.0

    def fig(self, name: str, value: float, unit: str, *, target: str | None = None,
            check: Callable[[float], bool] | None = None, note: str | None = None, signed: bool = False) -> None:
        value = float(value)
        met = None
        if check is not None and math.isfinite(value):
            met = bool(check(value))
        self.figures[name] = Figure(_round(value), unit, target, met, note, signed)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"wall_s": round(self.wall_s, 1)}
        if self.error:
            out["error"] = self.error
        if self.skipped:
            out["skipped"] = self.skipped
        out["figures"] = {k: f.value for k, f in self.figures.items()}
        out["units"] = {k: f.unit for k, f in self.figures.items()}
        signed = [k for k, f in self.figures.items() if f.signed]
        if signed:
            out["signed"] = signed
        notes = {k: f.note for k, f in self.figures.items() if f.note}
        if notes:
            out["notes"] = notes
        targets = {k: {"target": f.target, "met": f.met} for k, f in self.figures.items() if f.target}
        if targets:
            out["targets"] = targets
        out["details"] = self.details
        return out


def _round(v: float) -> float:
    if not math.isfinite(v) or v == 0:
        return v
    mag = abs(v)
    if mag >= 1000:
        return round(v, 1)
    if mag >= 1:
        return round(v, 3)
    return float(f"{v:.4g}")
