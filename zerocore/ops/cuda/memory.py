"""Pinned host buffers and async host<->device copies on side streams, for offload.

:class:`PinnedBufferPool` hands out page-locked CPU tensors from cached blocks (page aligned,
rounded at most 1/8 up, never to the next power of two) and reuses a block only after every
copy queued through it has finished, so a buffer may be dropped right after its copy is queued.
:class:`AsyncCopier` queues copies (and casts fused with copies) on its own side stream, ordered
after the work already queued on the current stream, and returns a ``torch.cuda.Event`` per
copy; the consumer waits on that event instead of synchronizing the device.
"""
from __future__ import annotations

import math

import torch

from .._checks import cast_args, check_int, copy_args
from ._lib import lib


class PinnedBufferPool:
    """Pinned host memory, cached. ``limit_bytes`` > 0 caps what the pool holds (a request over
    it raises RuntimeError after idle blocks are freed). ``cache=False``: for long-lived buffers
    (offloaded state, zerocore.offload.host_memory): sizes rounded to 4 KiB pages only, and a
    buffer freed with no copy recorded on it pending goes back to the system at once."""

    def __init__(self, limit_bytes: int = 0, *, cache: bool = True):
        self._pool = lib().CudaPinnedPool(int(limit_bytes), bool(cache))

    def empty(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A pinned CPU tensor of ``shape`` and ``dtype`` (contents undefined). Its block goes
        back to the pool when the tensor (and every view of it) is freed."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        shape = tuple(check_int(f"PinnedBufferPool.empty: 'shape[{i}]'", d, low=0) for i, d in enumerate(shape))
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"PinnedBufferPool.empty: 'dtype' must be a torch.dtype, got {type(dtype).__name__}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        raw = self._pool.tensor(math.prod(shape) * itemsize)
        return raw.view(dtype).view(shape)

    def record_stream(self, t: torch.Tensor, stream: torch.cuda.Stream) -> bool:
        """Work queued on ``stream`` uses ``t``'s block: the block is not handed out again before
        that work is done. Needed only for copies not made through :func:`copy_async` /
        :class:`AsyncCopier` (e.g. torch's own ``copy_(non_blocking=True)``). False if ``t`` is
        not from this pool."""
        return self._pool.record_use(t, stream.device.index, stream.cuda_stream)

    def owns(self, t: torch.Tensor) -> bool:
        return self._pool.capacity(t) > 0

    def trim(self) -> int:
        """Frees the cached blocks that are idle and whose copies are done; returns bytes freed."""
        return self._pool.trim()

    def stats(self) -> dict:
        """reserved_bytes, in_use_bytes, peak_reserved_bytes, limit_bytes, blocks, hits, misses."""
        return dict(self._pool.stats())


def copy_async(dst: torch.Tensor, src: torch.Tensor, *, stream: torch.cuda.Stream | None = None,
               pool: PinnedBufferPool | None = None) -> None:
    """cudaMemcpyAsync of ``src`` into ``dst`` (same number of bytes, contiguous; one side CUDA,
    the other CUDA or pinned CPU; pageable memory is refused) on ``stream`` (default: the current
    stream of the CUDA side's device). Does not order ``stream`` after other streams: see
    :class:`AsyncCopier` for that."""
    device = copy_args("copy_async", dst, src, device=None if stream is None else stream.device)
    stream = stream or torch.cuda.current_stream(device)
    lib().cuda_memcpy_async(dst, src, stream.cuda_stream)
    _mark_in_use(stream, pool, dst, src)


def _mark_in_use(stream: torch.cuda.Stream, pool: PinnedBufferPool | None, *tensors: torch.Tensor) -> None:
    current = torch.cuda.current_stream(stream.device)
    for t in tensors:
        if t.is_cuda:
            if stream != current:
                t.record_stream(stream)  # torch's caching allocator: keep the block until the copy is done
        elif pool is not None:
            pool.record_stream(t, stream)


class AsyncCopier:
    """Host<->device copies on a side stream of ``device``.

    ``copy(dst, src)`` / ``cast(dst, src)`` wait (on the GPU) for the work queued so far on the
    current stream, queue the copy on the side stream and return a ``torch.cuda.Event`` recorded
    after it. ``wait(event)`` makes the current stream wait for it; ``event.synchronize()`` makes
    the host wait. Pinned buffers from ``pool`` are protected until their copies finish."""

    def __init__(self, device=None, *, pool: PinnedBufferPool | None = None, priority: int = 0):
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"AsyncCopier needs a CUDA device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(self.device, priority=priority)
        self.pool = pool

    def _begin(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def _end(self, *tensors: torch.Tensor) -> torch.cuda.Event:
        _mark_in_use(self.stream, self.pool, *tensors)
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event:
        """Byte copy (same dtype and size): device->pinned host, pinned host->device or device->device."""
        if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor) and dst.dtype != src.dtype:
            raise TypeError(f"AsyncCopier.copy: dtypes differ ({src.dtype} -> {dst.dtype}); use cast()")
        copy_args("AsyncCopier.copy", dst, src, device=self.device)
        self._begin()
        lib().cuda_memcpy_async(dst, src, self.stream.cuda_stream)
        return self._end(dst, src)

    def cast(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event:
        """Copy with a dtype conversion in the same pass (e.g. fp16 grads on the GPU -> fp32 in a
        pinned buffer): the kernel reads/writes the host memory directly."""
        cast_args("AsyncCopier.cast", src, dst, None, cuda=True)  # the checks of zerocore.ops.cast
        side = src if src.is_cuda else dst
        if side.device != self.device:
            raise ValueError(f"AsyncCopier.cast: '{'src' if side is src else 'dst'}' is on {side.device} but the "
                             f"copy's stream is on {self.device}")
        self._begin()
        lib().cuda_cast(src, dst, self.stream.cuda_stream)
        return self._end(dst, src)

    def wait(self, event: torch.cuda.Event) -> None:
        """Makes the current stream wait for ``event`` (no host sync)."""
        torch.cuda.current_stream(self.device).wait_event(event)
