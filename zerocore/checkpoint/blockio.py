"""Files written in fixed-size blocks with a CRC-32 per block, and read back verified.

A checksum per block (not per file) is what lets a rank read only the byte ranges it needs and
still verify every byte it uses: it reads the blocks that cover its range (at most one extra
block at each end) and checks each block once. Writes are sequential and streaming: nothing is
staged beyond the caller's buffer. CRC-32 (zlib) runs at several GB/s, faster than the disks
it guards.
"""
from __future__ import annotations

import ctypes
import os
import zlib

import torch

BLOCK_BYTES = 1 << 20


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable buffer (no copy, no numpy); the
    caller keeps ``t`` alive while the view is used."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class ChecksumError(IOError):
    """A file of a checkpoint does not match what its manifest records."""


class BlockWriter:
    """Writes bytes to ``path`` (created new) one record after the other, keeping a CRC-32 of
    every ``block`` bytes. With ``aio`` (a :class:`zerocore.ops.AsyncIO`), tensors go to disk
    through it (O_DIRECT, several requests in flight) while the CRC of the same bytes is computed
    here, so checksumming overlaps the transfer and nothing passes through the page cache."""

    INFLIGHT_BYTES = 256 << 20  # tensors handed to ``aio`` are kept alive until written

    def __init__(self, path: str, block: int = BLOCK_BYTES, aio=None):
        self.path = path
        self.block = block
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._aio = aio
        self._inflight: list[torch.Tensor] = []
        self._inflight_bytes = 0
        self.size = 0
        self.crcs: list[int] = []
        self._crc = 0  # of the current partial block

    def write(self, data, tensor: torch.Tensor | None = None) -> int:
        """Appends ``data`` (a buffer; ``tensor``: the contiguous CPU tensor it views, if any);
        returns the file offset it starts at."""
        mv = memoryview(data).cast("B")
        start = self.size
        if self._aio is not None and tensor is not None and len(mv) >= (1 << 20):
            self._aio.async_pwrite(tensor, self.path, start)
            self._inflight.append(tensor)
            self._inflight_bytes += len(mv)
        else:
            done = 0
            while done < len(mv):  # a write may write less than asked
                done += os.pwrite(self._fd, mv[done:], start + done)
        pos = 0
        while pos < len(mv):
            room = self.block - self.size % self.block
            part = mv[pos:pos + room]
            self._crc = zlib.crc32(part, self._crc)
            self.size += len(part)
            pos += len(part)
            if self.size % self.block == 0:
                self.crcs.append(self._crc)
                self._crc = 0
        if self._inflight_bytes > self.INFLIGHT_BYTES:
            self._drain()
        return start

    def _drain(self) -> None:
        if self._inflight:
            self._aio.wait()
            self._inflight.clear()
            self._inflight_bytes = 0

    def close(self) -> dict:
        """Flushes to stable storage (fsync); returns the record the manifest keeps."""
        self._drain()
        if self.size % self.block:
            self.crcs.append(self._crc)
            self._crc = 0
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        if self._aio is not None:
            self._aio.close()
        return {"bytes": self.size, "block": self.block, "crc32": self.crcs}

    def abort(self) -> None:
        try:
            if self._inflight:
                self._aio.wait()
        except OSError:
            pass
        if self._aio is not None:
            self._aio.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class BlockReader:
    """Verified reads of byte ranges of one file. Each block is checked (read whole) the first
    time a read touches it; later reads of a checked block read only the bytes asked for."""

    def __init__(self, path: str, record: dict, aio=None):
        """``aio``: a :class:`zerocore.ops.AsyncIO` for runs of whole blocks (O_DIRECT); the
        page cache otherwise."""
        self.path = path
        self._aio = aio
        self.size = record["bytes"]
        self.block = record["block"]
        self.crcs = record["crc32"]
        try:
            actual = os.path.getsize(path)
        except FileNotFoundError:
            raise ChecksumError(f"zerocore checkpoint: file {path} is missing (the manifest lists it)") from None
        if actual != self.size:
            raise ChecksumError(f"zerocore checkpoint: file {path} has {actual} bytes; the manifest records "
                                f"{self.size} (truncated or replaced)")
        self._fd = os.open(path, os.O_RDONLY)
        self._checked: set[int] = set()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _pread_into(self, out: memoryview, offset: int) -> None:
        got = 0
        while got < len(out):
            n = os.preadv(self._fd, [out[got:]], offset + got)
            if n == 0:
                raise ChecksumError(f"zerocore checkpoint: file {self.path} ended at byte {offset + got} "
                                    f"(the manifest records {self.size})")
            got += n

    def _check(self, b: int, data: memoryview) -> None:
        if zlib.crc32(data) != self.crcs[b]:
            lo = b * self.block
            raise ChecksumError(f"zerocore checkpoint: file {self.path} is corrupt: bytes {lo}-{lo + len(data)} "
                                "do not match the checksum in the manifest")
        self._checked.add(b)

    def read_into(self, out, offset: int) -> None:
        """Fills ``out`` (a writable buffer) with the file's bytes from ``offset``, verified."""
        out = memoryview(out).cast("B")
        end = offset + len(out)
        if end > self.size:
            raise ChecksumError(f"zerocore checkpoint: the manifest points past the end of {self.path} "
                                f"(bytes {offset}-{end} of {self.size})")
        pos = offset
        while pos < end:
            b = pos // self.block
            lo, hi = b * self.block, min((b + 1) * self.block, self.size)
            stop = min(hi, end)
            dst = out[pos - offset:stop - offset]
            if b in self._checked:
                self._pread_into(dst, pos)
            elif pos == lo and stop == hi:  # whole blocks: read them in place, then check them
                last = b
                while (last + 1 not in self._checked and (last + 2) * self.block <= end
                       and (last + 2) * self.block <= self.size):
                    last += 1
                stop = (last + 1) * self.block if last > b else stop
                dst = out[pos - offset:stop - offset]
                if self._aio is not None and len(dst) >= (1 << 20):
                    self._aio.sync_pread(torch.frombuffer(dst, dtype=torch.uint8), self.path, pos)
                else:
                    self._pread_into(dst, pos)
                for k in range(b, last + 1):
                    self._check(k, dst[(k - b) * self.block:(k - b + 1) * self.block])
            else:
                whole = memoryview(bytearray(hi - lo))
                self._pread_into(whole, lo)
                self._check(b, whole)
                dst[:] = whole[pos - lo:stop - lo]
            pos = stop

    def read(self, offset: int, nbytes: int) -> bytearray:
        buf = bytearray(nbytes)
        self.read_into(buf, offset)
        return buf
