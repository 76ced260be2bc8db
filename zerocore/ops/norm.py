"""Sum of squares and an Inf/NaN flag in one pass (global grad norm, overflow check)."""
from __future__ import annotations

import torch

from . import _loader
from ._checks import sum_squares_args
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
