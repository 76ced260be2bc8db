"""zerocore.ops.cuda: the CUDA kernels (csrc/cuda) from Python.

zerocore.ops routes CUDA tensors here by itself when the kernels are built; import this module
for what only exists on GPUs (pinned buffer pool, async copies on side streams, device-side
gradient scale, no-sync sum of squares) or to check :func:`available` / :func:`build_info`.
Without the CUDA part every function raises :class:`CudaUnavailableError` naming why.
"""
from ._lib import CudaUnavailableError, available, build_info, unavailable_reason
from .kernels import adam_step, adam_step_multi, cast, pack, sum_squares, unpack
from .memory import AsyncCopier, PinnedBufferPool, copy_async

__all__ = ["available", "unavailable_reason", "build_info", "CudaUnavailableError", "adam_step", "adam_step_multi",
           "pack", "unpack", "cast", "sum_squares", "PinnedBufferPool", "AsyncCopier", "copy_async"]
