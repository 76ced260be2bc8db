"""Sum of squares and an Inf/NaN flag in one pass (global grad norm, overflow check)."""
from __future__ import annotations

import torch

from . import _loader
from ._checks import check_list, sum_squares_args, sum_squares_multi_args
from .cuda import _lib as _cuda


def sum_squares(t: torch.Tensor, *, sync: bool = True):
    """Returns (sum of squares accumulated in double, whether any element is Inf or NaN).

    For a CUDA tensor, ``sync=False`` returns them as 0-d CUDA tensors (float64, bool) without
    waiting for the GPU (zerocore.ops.cuda.sum_squares); on the CPU ``sync`` changes nothing."""
    if _cuda.routes(t):
        from .cuda import kernels

        return kernels.sum_squares(t, sync=sync)
    sum_squares_args("sum_squares", t, cuda=False)
    return _loader.load("norm").sum_squares(t)


def sum_squares_multi(tensors, *, sync: bool = True):
    """:func:`sum_squares` over many tensors in one native call: (the per-tensor sums of squares
    added in list order, whether any element of any tensor is Inf or NaN); the same double
    additions as summing :func:`sum_squares` results in a loop, so bit-identical to it.

    CUDA tensors (all on one device): ``sync=False`` returns a float64 device tensor
    ``[sum of squares, number of tensors holding Inf/NaN]`` without waiting for the GPU."""
    tensors = check_list("sum_squares_multi", "tensors", tensors)
    if not tensors:
        return 0.0, False
    if _cuda.routes(tensors[0]):
        from .cuda import kernels

        return kernels.sum_squares_multi(tensors, sync=sync)
    try:  # the binding checks every tensor before summing any
        return _loader.load("norm").sum_squares_multi(tensors)
    except (TypeError, ValueError):
        sum_squares_multi_args("sum_squares_multi", tensors, cuda=False)  # names the bad one
        raise
