"""Explicit per-group states with asserted transitions, instead of flags spread over the code.

Each group has a parameter state and a gradient state. An illegal transition is a bug in the
engine (or a user calling things out of order), and fails loudly with both states named.
"""
from __future__ import annotations

import enum


class ParamState(enum.Enum):
    """Where the group's full parameters are. Stages 0-2 keep them GATHERED between steps (after
    the optimizer updates the owned chunk they are SHARDED until the all-gather lands); stage 3
    goes back to SHARDED (full buffer freed) after each use."""

    SHARDED = "sharded"  # only the owned chunk is current
    GATHERING = "gathering"  # an all-gather into the full buffer is in flight
    GATHERED = "gathered"  # the full buffer is current on every rank


class GradState(enum.Enum):
    """Where the group's gradients for the current optimizer step are."""

    EMPTY = "empty"  # nothing accumulated since the last optimizer step
    FILLING = "filling"  # hooks are writing this micro-batch's gradients into the bucket
    REDUCING = "reducing"  # the bucket's reduction is in flight
    HELD = "held"  # the owned slice holds the reduced, accumulated gradient


_PARAM = {
    ParamState.SHARDED: {ParamState.GATHERING, ParamState.GATHERED},
    ParamState.GATHERING: {ParamState.GATHERED},
    ParamState.GATHERED: {ParamState.SHARDED},
}
_GRAD = {
    GradState.EMPTY: {GradState.FILLING, GradState.EMPTY},
    GradState.FILLING: {GradState.REDUCING, GradState.EMPTY},
    GradState.REDUCING: {GradState.HELD},
    GradState.HELD: {GradState.FILLING, GradState.EMPTY},
}


class StateError(RuntimeError):
    """An illegal state transition of a flat group."""


class Tracked:
    """A state value whose transitions are checked against a table."""

    __slots__ = ("value", "_table", "_what")

    def __init__(self, initial: enum.Enum, table: dict, what: str):
        self.value, self._table, self._what = initial, table, what

    def to(self, new: enum.Enum) -> None:
        if new not in self._table[self.value]:
            raise StateError(f"{self._what}: illegal transition {self.value.name} -> {new.name}")
        self.value = new

    def expect(self, *allowed: enum.Enum) -> None:
        if self.value not in allowed:
            names = " or ".join(a.name for a in allowed)
            raise StateError(f"{self._what}: is {self.value.name}, expected {names}")

    def __eq__(self, other):
        return self.value == other

    def __hash__(self):
        return hash(self.value)

    def __repr__(self):
        return f"{self._what}={self.value.name}"


def param_state(group: int, initial: ParamState = ParamState.GATHERED) -> Tracked:
    return Tracked(initial, _PARAM, f"group {group} params")


def grad_state(group: int) -> Tracked:
    return Tracked(GradState.EMPTY, _GRAD, f"group {group} grads")
