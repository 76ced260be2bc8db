"""Pack many tensors into one flat bucket (gaps zeroed) and unpack it back."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _loader
from .cuda import _lib as _cuda


def _offsets(offsets: Sequence[int], count: int) -> list[int]:
    offs = [int(o) for o in offsets]
    if len(offs) != count:
        raise ValueError(f"got {count} tensors but {len(offs)} offsets")
    return offs


def pack(tensors: Sequence[torch.Tensor], offsets: Sequence[int], flat: torch.Tensor) -> torch.Tensor:
    """Copies ``tensors[i]`` to ``flat[offsets[i]:offsets[i]+numel]``; every element of ``flat``
    not covered is set to zero. Offsets are in elements of ``flat``'s dtype, which every tensor
    must share. Returns ``flat``."""
    if _cuda.routes(flat):  # a CUDA bucket: one launch on the GPU (zerocore.ops.cuda)
        from .cuda import kernels

        return kernels.pack(tensors, offsets, flat)
    _loader.load("flatten").pack(list(tensors), _offsets(offsets, len(tensors)), flat)
    return flat


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """Copies ``flat[offsets[i]:offsets[i]+numel]`` back into ``tensors[i]``."""
    if _cuda.routes(flat):  # a CUDA bucket: one launch on the GPU (zerocore.ops.cuda)
        from .cuda import kernels

        return kernels.unpack(flat, tensors, offsets)
    _loader.load("flatten").unpack(flat, list(tensors), _offsets(offsets, len(tensors)))
