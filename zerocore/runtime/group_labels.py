"""The names divergence errors give an engine's groups (runtime/engine.py keeps one ``GroupLabels``)."""
from __future__ import annotations


class GroupLabels:
    """The names divergence errors give the groups (a unit's module path, else the group's first
    persistent parameter): plain strings, so the guard holds no reference to the engine."""

    def __init__(self):
        self.names: dict[int, str] = {}

    def fill(self, groups, gatherer) -> None:
        for g in groups:  # frozen groups are named by their unit below
            self.names[g.index] = f"group {g.index} (persistent parameters '{g.layout.slots[0].name}'...)"
        if gatherer is not None:
            for index, unit in gatherer.by_group.items():
                self.names[index] = unit.label

    def __call__(self, op, index: int) -> str:
        return self.names.get(index, f"group {index}")
