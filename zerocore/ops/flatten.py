"""Pack many tensors into one flat bucket (gaps zeroed) and unpack it back."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _loader
from ._checks import _pack_fast, pack_args
from .cuda import _lib as _cuda


def pack(tensors: Sequence[torch.Tensor], offsets: Sequence[int], flat: torch.Tensor) -> torch.Tensor:
    """Copies ``tensors[i]`` to ``flat[offsets[i]:offsets[i]+numel]``; every element of ``flat``
    not covered is set to zero. Offsets are in elements of ``flat``'s dtype, which every tensor
    must share; ranges may not overlap, nor may a tensor share memory with ``flat``. Returns ``flat``."""
    # The reducer packs each group with one call: the usual case costs two Python calls (this and
    # the fast checks), so the CUDA routing test and the loaded module are read inline.
    tensor = isinstance(flat, torch.Tensor)
    if (not tensor or flat.is_cuda) and _cuda.routes(flat):  # a CUDA bucket: one launch on the GPU
        from .cuda import kernels

        return kernels.pack(tensors, offsets, flat)
    args = _pack_fast(tensors, offsets, flat, False) if tensor else None
    checked, offs = args if args is not None else pack_args("pack", tensors, offsets, flat, cuda=False)
    try:
        (_loader._module or _loader.load("flatten")).pack(checked, offs, flat)
        return flat
    except (TypeError, ValueError) as exc:
        refused = exc
    # The binding refused what the fast checks let through (a shrunk storage): the full checks
    # name it, raised here rather than inside the except so the binding's error is not chained.
    pack_args("pack", checked, offs, flat, cuda=False, fast=False)
    raise refused


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """Copies ``flat[offsets[i]:offsets[i]+numel]`` back into ``tensors[i]`` (same rules as :func:`pack`)."""
    if _cuda.routes(flat):  # a CUDA bucket: one launch on the GPU (zerocore.ops.cuda)
        from .cuda import kernels

        return kernels.unpack(flat, tensors, offsets)
    tensors, offs = pack_args("unpack", tensors, offsets, flat, cuda=False)
    _loader.load("flatten").unpack(flat, tensors, offs)
