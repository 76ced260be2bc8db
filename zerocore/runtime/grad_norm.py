"""The step's global gradient norm and overflow flag, read by the host once per step.

Each group's sum of squares and Inf/NaN flag come from one native pass (``ops.sum_squares``);
on a GPU they stay device tensors (``sync=False``) and are summed there, so the host waits
once, after the cross-rank sum, instead of twice per group.
"""
from __future__ import annotations

import torch

from .. import ops
from ..comm import Comm

_REDUCE_DTYPES = {"fp32": torch.float32, "float32": torch.float32}


def reduce_dtype(name: str | None, training: torch.dtype) -> torch.dtype | None:
    """``zero_optimization.reduce_dtype``: None = the training dtype (no conversion)."""
    if name is None:
        return None
    dt = _REDUCE_DTYPES[name]
    return None if dt == training else dt


def grad_sumsq(grads: list[torch.Tensor], comm: Comm, *, across_ranks: bool) -> tuple[float, bool]:
    """(sum of squares of every tensor in ``grads``, summed over ranks when ``across_ranks``;
    whether any element anywhere is Inf/NaN)."""
    parts = [ops.sum_squares(g, sync=False) for g in grads]
    if parts and isinstance(parts[0][0], torch.Tensor):  # device results: one stacked read
        vals = torch.stack([torch.stack([s.double(), b.double()]) for s, b in parts]).sum(0)
        if across_ranks:
            comm.all_reduce(vals)
        sumsq, nbad = vals.tolist()
        return sumsq, nbad > 0
    sumsq, bad = 0.0, False
    for s, b in parts:  # a loop, not generators: no Python call per group
        sumsq += s
        bad = bad or b
    return sum_across(comm, sumsq, bad, across_ranks=across_ranks)


def sum_across(comm: Comm, sumsq: float, bad: bool, *, across_ranks: bool) -> tuple[float, bool]:
    """This rank's (sum of squares, any Inf/NaN) summed over the ranks in one small collective
    (when ``across_ranks``; else as it is)."""
    if across_ranks:
        sumsq, nbad = comm.sum_floats([sumsq, float(bad)])
        bad = nbad > 0
    return sumsq, bad
