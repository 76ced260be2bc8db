"""dtype conversion between fp32, bf16 and fp16 with round-to-nearest-even."""
from __future__ import annotations

import torch

from . import _loader
from ._checks import cast_args
from .cuda import _lib as _cuda


def cast(src: torch.Tensor, dst: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Converts ``src`` into ``dst`` (allocated as ``dtype`` if not given; both given: they must
    agree). NaN stays NaN (quiet), Inf stays Inf, finite values round to nearest even. ``dst``
    may not share memory with ``src``. Returns ``dst``."""
    if _cuda.routes(src, dst):  # CUDA tensors (one side may be pinned CPU memory): zerocore.ops.cuda
        from .cuda import kernels

        return kernels.cast(src, dst, dtype)
    src, dst, dtype = cast_args("cast", src, dst, dtype, cuda=False)
    if dst is None:
        dst = torch.empty(src.shape, dtype=dtype)
    _loader.load("cast").cast(src, dst)
    return dst
