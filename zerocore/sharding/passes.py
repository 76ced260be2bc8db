"""Stage 3's pass recording: the order units ran in during one forward or backward pass,
against the order recorded from the last pass, and the window prefetch may gather from.

Every rank decides identically from its own recording (the divergence guard checks that they
really agree), so prefetch issues the same collectives in the same order everywhere.
"""
from __future__ import annotations

import bisect
import itertools


class Pass:
    """The order units run in during one forward or one backward pass, against the recorded one."""

    def __init__(self, recorded: list[int] | None, sizes: list[int]):
        self.recorded = recorded
        # A visit appends to ``order`` and clears ``on_trace`` once the pass departs from the
        # recorded order.
        self.order: list[int] = []
        self.on_trace = recorded is not None
        # Prefetch keeps a cursor into the recorded order (positions before it were offered
        # already) and finds the end of its budget by bisection on the running element counts,
        # so a pass costs O(units), not O(units^2).
        self.cursor = 0
        self.prefix = list(itertools.accumulate(map(sizes.__getitem__, recorded), initial=0)) if recorded else []

    def visit(self, pos: int) -> int:
        """Unit ``pos`` runs now; returns its index in this pass's order."""
        i = len(self.order)
        self.order.append(pos)
        if self.on_trace and (i >= len(self.recorded) or self.recorded[i] != pos):
            self.on_trace = False
        return i

    def window(self, i: int, budget: int) -> range:
        """Indices into the recorded order after visit ``i`` whose elements, counted from
        ``i + 1``, fit in ``budget``, less those already offered."""
        if not self.on_trace or i + 1 >= len(self.recorded):
            return range(0)
        end = bisect.bisect_right(self.prefix, self.prefix[i + 1] + budget) - 1
        start = max(self.cursor, i + 1)
        return range(start, max(start, end))

    def final(self) -> list[int] | None:
        """The order to record for the next pass (None: keep what was recorded)."""
        if self.recorded is None or not self.on_trace or len(self.order) != len(self.recorded):
            return list(self.order)
        return None
