"""Host buffers for offloaded state: page-locked when a CUDA device will copy to/from them
(``pin_memory`` true and CUDA present), plain host memory otherwise. On a CPU-only machine the
training device *is* host memory, so there is nothing to pin: said once in a log line, never
an error."""
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


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised host tensor (page-locked when ``pin``), known as host memory to
    ``zerocore.debug.host_waits`` (which on a CPU device counts every other tensor as device memory)."""
    return mark_host(torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin))


def host_zeros(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return host_empty(numel, dtype, pin).zero_()


def host_copy(src: torch.Tensor, pin: bool) -> torch.Tensor:
    out = host_empty(src.numel(), src.dtype, pin)
    out.copy_(src.reshape(-1))
    return out
