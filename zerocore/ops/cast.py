"""dtype conversion between fp32, bf16 and fp16 with round-to-nearest-even."""
from __future__ import annotations

import torch

from . import _loader
from .cuda import _lib as _cuda


def cast(src: torch.Tensor, dst: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Converts ``src`` into ``dst`` (allocated as ``dtype`` if not given). NaN stays NaN (quiet),
    Inf stays Inf, finite values round to nearest even. Returns ``dst``."""
    if _cuda.routes(src, dst):  # CUDA tensors (one side may be pinned CPU memory): zerocore.ops.cuda
        from .cuda import kernels

        return kernels.cast(src, dst, dtype)
    if dst is None:
        if dtype is None:
            raise ValueError("cast needs 'dst' or 'dtype'")
        dst = torch.empty(src.shape, dtype=dtype)
    _loader.load("cast").cast(src, dst)
    return dst
