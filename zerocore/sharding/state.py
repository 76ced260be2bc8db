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

    # Members compare by identity, so hashing by identity is consistent; Enum's own __hash__ is a
    # Python function, and the transition tables hash a state on every change (hot at stage 3).
    __hash__ = object.__hash__


class GradState(enum.Enum):
    """Where the group's gradients for the current optimizer step are."""

    EMPTY = "empty"  # nothing accumulated since the last optimizer step
    FILLING = "filling"  # hooks are writing this micro-batch's gradients into the bucket
    REDUCING = "reducing"  # the bucket's reduction is in flight
    HELD = "held"  # the owned slice holds the reduced, accumulated gradient

    __hash__ = object.__hash__  # as ParamState's


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
# Abort edges: a backward that raised drops the reduction in flight. Taken only through
# ``Tracked.abort``, so a normal step can never make them.
_GRAD_ABORT = {
    GradState.REDUCING: {GradState.FILLING, GradState.HELD},  # HELD: earlier micro-batches are kept
}


class StateError(RuntimeError):
    """An illegal state transition of a flat group."""


class Tracked:
    """A state value whose transitions are checked against a table."""

    __slots__ = ("value", "_table", "_aborts", "_initial", "_what")

    def __init__(self, initial: enum.Enum, table: dict, what: str, aborts: dict | None = None):
        self.value, self._table, self._what = initial, table, what
        self._initial, self._aborts = initial, aborts or {}

    def to(self, new: enum.Enum) -> None:
        """The one way a state changes in normal operation (the hot paths call it too)."""
        if new not in self._table[self.value]:
            raise StateError(f"{self._what}: illegal transition {self.value.name} -> {new.name}")
        self.value = new

    def abort(self, new: enum.Enum) -> None:
        """A declared abort edge (a failed backward unwinding), or a normal transition."""
        if new not in self._aborts.get(self.value, ()) and new not in self._table[self.value]:
            raise StateError(f"{self._what}: illegal abort {self.value.name} -> {new.name}")
        self.value = new

    def reset(self) -> None:
        """Back to the state the group started in (a fresh engine's)."""
        self.value = self._initial

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


def move_all(states, new: enum.Enum) -> None:
    """``s.to(new)`` for every state in ``states``, with no Python call per state (the step moves
    every group, one per unit at stage 3); an illegal one raises through ``to``, naming it."""
    for s in states:
        if new not in s._table[s.value]:
            s.to(new)
        s.value = new


def expect_all(states, *allowed: enum.Enum) -> None:
    """``s.expect(*allowed)`` for every state in ``states``, with no Python call per state."""
    for s in states:
        if s.value not in allowed:
            s.expect(*allowed)


def param_state(group: int, initial: ParamState = ParamState.GATHERED) -> Tracked:
    return Tracked(initial, _PARAM, f"group {group} params")


def grad_state(group: int) -> Tracked:
    return Tracked(GradState.EMPTY, _GRAD, f"group {group} grads", aborts=_GRAD_ABORT)
