"""A report that sorts things into named lists, each thing in exactly one (what a collection
removed, by kind; what became of a group's members, by fate)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Tally:
    """The base of such a report: a dataclass whose every field is a list."""

    def by_name(self) -> dict[str, list[Any]]:
        """Each list, by its field's name (in field order)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def total(self) -> int:
        """How many things in all the lists."""
        return sum(len(items) for items in self.by_name().values())
