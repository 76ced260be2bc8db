"""The step's global gradient norm and overflow flag, read by the host once per step.

Every group's sum of squares and Inf/NaN flag come from one native call over the list
(``ops.sum_squares_multi``: a pass per tensor, no Python per group); on a GPU they stay on the
device (``sync=False``) and are summed there, so the host waits once, after the cross-rank sum.
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
    got = ops.sum_squares_multi(grads, sync=False)
    if isinstance(got, torch.Tensor):  # device results [sum, tensors with Inf/NaN]: one read
        if across_ranks:
            comm.all_reduce(got)
        sumsq, nbad = got.tolist()
        return sumsq, nbad > 0
    return sum_across(comm, *got, across_ranks=across_ranks)


def sum_across(comm: Comm, sumsq: float, bad: bool, *, across_ranks: bool) -> tuple[float, bool]:
    """This rank's (sum of squares, any Inf/NaN) summed over the ranks in one small collective
    (when ``across_ranks``; else as it is)."""
    if across_ranks:
        sumsq, nbad = comm.sum_floats([sumsq, float(bad)])
        bad = nbad > 0
    return sumsq, bad
