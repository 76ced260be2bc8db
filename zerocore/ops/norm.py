"""Sum of squares and an Inf/NaN flag in one pass (global grad norm, overflow check)."""
from __future__ import annotations

import torch

from . import _loader


def sum_squares(t: torch.Tensor) -> tuple[float, bool]:
    """Returns (sum of squares accumulated in double, whether any element is Inf or NaN)."""
    return _loader.load("norm").sum_squares(t)
