"""CRC32C of a tensor's bytes: the checksum written with every NVMe swap tile and verified when
the tile is read back (SSE4.2 ``crc32`` instruction when the CPU has it, a table otherwise)."""
from __future__ import annotations

import torch

from . import _loader
from ._checks import check_int


def crc32c(tensor: torch.Tensor, crc: int = 0) -> int:
    """CRC32C (Castagnoli) of ``tensor``'s bytes (any dtype, contiguous, in host memory) as an
    int in [0, 2**32). ``crc``: a previous result to continue from, so that
    ``crc32c(b, crc32c(a))`` is the checksum of a's bytes followed by b's."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"crc32c: 'tensor' must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"crc32c: 'tensor' is on {tensor.device}; the checksum runs on host memory (swap tiles)")
    if not tensor.is_contiguous():
        raise ValueError("crc32c: 'tensor' must be contiguous (call .contiguous())")
    crc = check_int("crc32c: 'crc'", crc, low=0, high=2**32 - 1)
    return _loader.load("checksum").crc32c(tensor, crc, True)


def crc32c_uses_hardware() -> bool:
    """Whether :func:`crc32c` runs on the SSE4.2 instruction on this CPU."""
    return bool(_loader.load("checksum").crc32c_hardware())
