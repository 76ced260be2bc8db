"""Host buffers for offloaded state: page-locked when a CUDA device will copy to/from them
(``pin_memory`` true and CUDA present), plain host memory otherwise. On a CPU-only machine the
training device *is* host memory, so there is nothing to pin: said once in a log line, never
an error. Page-locked buffers of ``EXACT_PIN_BYTES`` and more are sized to the page by zerocore's
own allocator (torch's rounds them up to a power of two), see below."""
from __future__ import annotations

import logging

import torch

from ..debug.host_waits import mark_host

log = logging.getLogger("zerocore.offload")
_said_unpinned = False


def should_pin(pin_memory: bool, device: torch.device) -> bool:
    global _said_unpinned
    if not pin_memory:
        return False
    if device.type == "cuda" and torch.cuda.is_available():
        return True
    if not _said_unpinned:
        _said_unpinned = True
        log.info("zerocore offload: pin_memory requested but the training device is %s (no CUDA device): "
                 "offloaded state uses plain host memory", device)
    return False


# Page-locked buffers from this size up come from zerocore's own pinned allocator, sized to the page: torch's
# (``pin_memory=True``) rounds every block up to the next power of two, which for the offloaded state of a
# 311M-parameter GPT held 1.16-1.73x the bytes asked (8.00 GiB for 4.63 with DeepSpeed's default bucket:
# benchmarks/pinned_rounding.py), pinned host memory a user's machine runs out of. Smaller buffers (a step's
# few flags and norms) stay with torch's allocator, which caches them across steps.
EXACT_PIN_BYTES = 1 << 20
_exact_pool = None


def _exact_pinned(numel: int, dtype: torch.dtype) -> torch.Tensor | None:
    """``numel`` elements of page-locked memory sized to the page (freed to the system with the tensor),
    or None where zerocore's CUDA extension is not available (then torch pins it)."""
    global _exact_pool
    if _exact_pool is None:
        try:
            from ..ops.cuda import PinnedBufferPool

            _exact_pool = PinnedBufferPool(cache=False)
        except Exception as e:  # noqa: BLE001 - an extension built without CUDA, or none: torch's pinning works too
            log.debug("zerocore offload: pinned buffers from torch's allocator (%s)", e)
            _exact_pool = False
    return _exact_pool.empty(numel, dtype) if _exact_pool else None


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised host tensor (page-locked when ``pin``), known as host memory to
    ``zerocore.debug.host_waits`` (which on a CPU device counts every other tensor as device memory)."""
    if pin and numel * dtype.itemsize >= EXACT_PIN_BYTES:  # (itemsize: no tensor made; fetch calls this a step)
        t = _exact_pinned(numel, dtype)
        if t is not None:
            return mark_host(t)
    return mark_host(torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin))


def host_zeros(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return host_empty(numel, dtype, pin).zero_()


def host_copy(src: torch.Tensor, pin: bool) -> torch.Tensor:
    out = host_empty(src.numel(), src.dtype, pin)
    out.copy_(src.reshape(-1))
    return out
