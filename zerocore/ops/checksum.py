"""CRC32C of a tensor's bytes: the checksum of NVMe swap tiles and of checkpoint blocks (SSE4.2
``crc32`` instruction on three interleaved streams when the CPU has it, a table otherwise)."""
from __future__ import annotations

import torch

from . import _loader
from ._checks import check_int, check_memory


def _host_bytes(tensor, op: str, name: str) -> None:
    what = f"{op}: '{name}'"
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{what} is on {tensor.device}; the checksum runs on host memory")
    if not tensor.is_contiguous():
        raise ValueError(f"{what} must be contiguous (call .contiguous())")
    check_memory(op, name, tensor)  # a freed storage would be read through a null pointer


def crc32c(tensor: torch.Tensor, crc: int = 0) -> int:
    """CRC32C (Castagnoli) of ``tensor``'s bytes (any dtype, contiguous, in host memory) as an
    int in [0, 2**32). ``crc``: a previous result to continue from, so that
    ``crc32c(b, crc32c(a))`` is the checksum of a's bytes followed by b's."""
    _host_bytes(tensor, "crc32c", "tensor")
    crc = check_int("crc32c: 'crc'", crc, low=0, high=2**32 - 1)
    return _loader.load("checksum").crc32c(tensor, crc, True)


def copy_crc32c(src: torch.Tensor, dst: torch.Tensor, crc: int = 0) -> int:
    """Copies ``src``'s bytes into ``dst`` (host tensors, contiguous, the same byte count, any
    dtypes, not overlapping) and returns their CRC32C continued from ``crc``, in one pass over
    the data: checksumming what is copied costs about what the copy costs."""
    _host_bytes(src, "copy_crc32c", "src")
    _host_bytes(dst, "copy_crc32c", "dst")
    crc = check_int("copy_crc32c: 'crc'", crc, low=0, high=2**32 - 1)
    return _loader.load("checksum").copy_crc32c(src, dst, crc)


def crc32c_uses_hardware() -> bool:
    """Whether :func:`crc32c` runs on the SSE4.2 instruction on this CPU."""
    return bool(_loader.load("checksum").crc32c_hardware())
