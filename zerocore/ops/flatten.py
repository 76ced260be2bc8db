"""Pack many tensors into one flat bucket (gaps zeroed) and unpack it back."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _loader
from ._checks import pack_args
from .cuda import _lib as _cuda


def pack(tensors: Sequence[torch.Tensor], offsets: Sequence[int], flat: torch.Tensor) -> torch.Tensor:
    """Copies ``tensors[i]`` to ``flat[offsets[i]:offsets[i]+numel]``; every element of ``flat``
    not covered is set to zero. Offsets are in elements of ``flat``'s dtype, which every tensor
    must share; ranges may not overlap, nor may a tensor share memory with ``flat``. Returns ``flat``."""
    if _cuda.routes(flat):  # a CUDA bucket: one launch on the GPU (zerocore.ops.cuda)
        from .cuda import kernels

        return kernels.pack(tensors, offsets, flat)
    tensors, offs = pack_args("pack", tensors, offsets, flat, cuda=False)
    _loader.load("flatten").pack(tensors, offs, flat)
    return flat


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """Copies ``flat[offsets[i]:offsets[i]+numel]`` back into ``tensors[i]`` (same rules as :func:`pack`)."""
    if _cuda.routes(flat):  # a CUDA bucket: one launch on the GPU (zerocore.ops.cuda)
        from .cuda import kernels

        return kernels.unpack(flat, tensors, offsets)
    tensors, offs = pack_args("unpack", tensors, offsets, flat, cuda=False)
    _loader.load("flatten").unpack(flat, tensors, offs)
