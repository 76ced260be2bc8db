"""Writing checkpoint files of CRC32C-checksummed blocks (``blockio.py`` has the format, the
shared buffer and handle pools, and the reading side).

A write copies each tensor into the current 4096-aligned I/O buffer with ``ops.copy_crc32c``
(the copy and the checksum are one pass over the data, the only copy on the way to disk) and
hands full buffers to a sink: :class:`FileSink` writes them through ``zerocore.ops.AsyncIO``,
``RING`` requests in flight, each with its own handle so that waiting for the oldest does not wait
for the others (``pwrite`` and the page cache without AsyncIO); :class:`ImageSink` keeps them for
an asynchronous save. A large host tensor that stays unchanged until the file is closed (resident
optimizer state during a synchronous save) is not copied: it is placed in the file at the offset
that makes its pages line up with the file's, and O_DIRECT writes it from its own memory (its
checksum is then the only pass over it).
"""
from __future__ import annotations

import os

import torch

from .. import ops
from . import blockio
from .blockio import ALGO, IO_BYTES, POOL, RING, _close_handles, aio_handles, as_bytes, byte_view
from .staging import ALIGN

KEPT_MIN_BYTES = 1 << 20  # smaller tensors are copied: a request and up to 8 KiB of padding each cost more
_ZEROS = torch.zeros(ALIGN, dtype=torch.uint8)


def _pwrite_all(fd: int, mv: memoryview, offset: int) -> None:
    done = 0
    while done < len(mv):  # a write may write less than asked
        done += os.pwrite(fd, mv[done:], offset + done)



class FileSink:
    """Where a :class:`BlockWriter`'s bytes go: full buffers written at their offsets as they
    fill, and the caller's own memory where it can be written as it is (:meth:`submit_external`),
    ``RING`` requests in flight (AsyncIO, O_DIRECT) or written at once (page cache)."""

    direct = True  # takes the caller's memory (see BlockWriter.write)

    def __init__(self, path: str, aio: dict | None, ring: int = RING):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._handles = aio_handles(aio, ring)
        # per slot: (the memory being written, the pool's buffer it lies in, or None) or None
        self._inflight: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [None] * ring
        self._next = 0

    def take(self, nbytes: int) -> torch.Tensor:
        return POOL.take(nbytes)

    def _start(self, data: torch.Tensor, offset: int, pooled: torch.Tensor | None) -> torch.Tensor | None:
        """Writes ``data`` at ``offset`` in the next slot, then frees the slot after that one
        (waiting for its request): returns the pool's buffer that slot held, or None."""
        k = self._next
        self._next = (k + 1) % len(self._handles)
        h = self._handles[k]
        if h is None:
            _pwrite_all(self._fd, byte_view(data), offset)
            return pooled
        h.async_pwrite(data, self.path, offset)
        self._inflight[k] = (data, pooled)
        nxt = self._next  # the oldest request in flight is in the next slot
        if self._inflight[nxt] is None:
            return None
        self._handles[nxt].wait()
        (_, done), self._inflight[nxt] = self._inflight[nxt], None
        return done

    def submit(self, buf: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
        """Writes ``buf[:nbytes]`` at ``offset``; returns the buffer to fill next."""
        free = self._start(buf[:nbytes], offset, buf)
        return POOL.take(buf.numel()) if free is None else free

    def submit_external(self, data: torch.Tensor, offset: int) -> None:
        """Writes ``data`` (uint8, the caller's memory, which keeps its contents until
        :meth:`close`) at ``offset``, with no copy."""
        free = self._start(data, offset, None)
        if free is not None:
            POOL.give(free)

    def _drain(self, raise_errors: bool) -> None:
        for k, h in enumerate(self._handles):
            if self._inflight[k] is not None:
                try:
                    h.wait()
                except OSError:
                    if raise_errors:
                        raise
                finally:
                    _, pooled = self._inflight[k]
                    self._inflight[k] = None
                    if pooled is not None:
                        POOL.give(pooled)

    def close(self) -> None:
        """Every write finished and on stable storage (fsync)."""
        try:
            self._drain(True)
            os.fsync(self._fd)
        finally:
            self.abort()

    def abort(self) -> None:
        self._drain(False)
        _close_handles(self._handles)
        self._handles = [None] * len(self._handles)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class ImageSink:
    """Keeps a file's buffers in memory, to be written later by :meth:`write_file` (an
    asynchronous save: the caller waits only for the copy). The buffers come from ``cache`` (a
    list the owner keeps between saves, so a steady state of saves faults no fresh memory) and
    go back to it once written."""

    direct = False  # a snapshot: every byte is copied (the caller's memory changes after the call)

    def __init__(self, cache: list):
        self.cache = cache
        self.parts: list[tuple[torch.Tensor, int, int]] = []

    def take(self, nbytes: int = IO_BYTES) -> torch.Tensor:
        while self.cache:
            buf = self.cache.pop()
            if buf.numel() == nbytes:
                return buf
        return ops.aligned_pinned_empty(nbytes, torch.uint8, lock=False)

    def submit(self, buf: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
        self.parts.append((buf, offset, nbytes))
        return self.take(buf.numel())

    def write_file(self, path: str, aio: dict | None) -> None:
        """Writes the image to ``path`` (created new), several requests in flight, and fsyncs."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        (h,) = aio_handles(aio, 1)
        try:
            for buf, offset, nbytes in self.parts:
                if h is None:
                    _pwrite_all(fd, byte_view(buf[:nbytes]), offset)
                else:  # the handle keeps queue_depth blocks of all of them in flight
                    h.async_pwrite(buf[:nbytes], path, offset)
            if h is not None:
                h.wait()
            os.fsync(fd)
        finally:
            _close_handles([h])
            os.close(fd)
        self.release()

    def release(self) -> None:
        self.cache.extend(buf for buf, _, _ in self.parts)
        self.parts = []

    def abort(self) -> None:
        self.release()


class BlockWriter:
    """Appends tensors to a file (through ``sink``), keeping a CRC32C of every ``block`` bytes.
    Each tensor is copied once, into the current aligned buffer, checksummed in the same pass
    (a device tensor is copied to the buffer by the device and checksummed there); a large host
    tensor whose memory stays unchanged until :meth:`close` (``kept=True``) is not copied at all
    where the sink writes the caller's memory (:meth:`_write_kept`)."""

    def __init__(self, sink, block: int | None = None, io_bytes: int = IO_BYTES):
        """``io_bytes``: bytes per I/O buffer, a multiple of ``block``."""
        block = blockio.BLOCK_BYTES if block is None else block  # read here: tests shrink it to get many blocks
        if io_bytes % block:
            raise ValueError(f"block must divide the I/O buffer's {io_bytes} bytes, got {block}")
        self.sink = sink
        self.block = block
        self.io_bytes = io_bytes
        self.size = 0
        self.crcs: list[int] = []
        self._crc = 0  # of the current partial block
        self._buf = sink.take(io_bytes)
        self._fill = 0  # bytes of the file at [size - fill, size) are in the buffer; size - fill is aligned

    def write(self, t: torch.Tensor, kept: bool = False, paged: bool = False) -> int:
        """Appends ``t``'s bytes (any dtype, any device); returns the file offset they start at.
        ``kept``: ``t``'s memory keeps its contents until :meth:`close` (it may be written from
        where it is). ``paged``: a tensor of at least a block starts on a page of the file (where
        it is not written from its own memory, which places it by its address), so that a load
        reads it by O_DIRECT straight into page-aligned memory (``blockio.read_into``)."""
        src = as_bytes(t)
        if kept and self.sink.direct and src.device.type == "cpu" and src.numel() >= KEPT_MIN_BYTES:
            return self._write_kept(src)
        if paged and src.numel() >= self.block:
            self._put(_ZEROS[:-self.size % ALIGN])
        start = self.size
        self._put(src)
        return start

    def write_bytes(self, data: bytes) -> int:
        return self.write(torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else
                          torch.empty(0, dtype=torch.uint8))

    def _put(self, src: torch.Tensor) -> None:
        """``src`` (uint8, any device) copied into the buffers, which go to the sink as they fill."""
        n, pos = src.numel(), 0
        on_host = src.device.type == "cpu"
        while pos < n:
            k = min(n - pos, self.io_bytes - self._fill)
            dst = self._buf[self._fill:self._fill + k]
            if on_host:
                self._checksum(src[pos:pos + k], dst)
            else:
                dst.copy_(src[pos:pos + k])
                self._checksum(dst)
            self._fill += k
            pos += k
            if self._fill == self.io_bytes:
                self._flush()

    def _flush(self) -> None:
        if self._fill:
            self._buf = self.sink.submit(self._buf, self.size - self._fill, self._fill)
            self._fill = 0

    def _write_kept(self, src: torch.Tensor) -> int:
        """``src``'s memory goes to the file as it is: placed at a file offset with the same
        remainder modulo 4096 as its address (zeros pad the file up to there), so that the part
        between its first and last page boundaries is page-aligned both in memory and in the file
        and O_DIRECT moves it with no bounce buffer; the partial pages at its two ends are
        copied into the buffers. Only the checksum reads the memory."""
        r = src.data_ptr() % ALIGN
        self._put(_ZEROS[:(r - self.size) % ALIGN])
        start = self.size
        head = min(src.numel(), (ALIGN - r) % ALIGN)  # bytes up to its first page boundary
        self._put(src[:head])
        end = head + (src.numel() - head) // ALIGN * ALIGN
        if end > head:  # here size is page-aligned, and so is the buffer's start
            self._flush()
            body = src[head:end]
            self._checksum(body)
            self.sink.submit_external(body, self.size - body.numel())
        self._put(src[end:])
        return start

    def _checksum(self, src: torch.Tensor, dst: torch.Tensor | None = None) -> None:
        """The next ``src.numel()`` bytes of the file into the per-block CRCs; with ``dst`` they
        are copied there in the same pass."""
        done, n = 0, src.numel()
        while done < n:
            room = self.block - self.size % self.block
            m = min(room, n - done)
            if dst is None:
                self._crc = blockio._native().crc32c(src[done:done + m], self._crc, True)
            else:
                self._crc = blockio._native().copy_crc32c(src[done:done + m], dst[done:done + m], self._crc)
            self.size += m
            done += m
            if m == room:
                self.crcs.append(self._crc)
                self._crc = 0

    def close(self) -> dict:
        """Writes what is buffered, flushes to stable storage; returns the manifest's record."""
        self._flush()
        if self.size % self.block:
            self.crcs.append(self._crc)
            self._crc = 0
        self._give_back()
        self.sink.close() if isinstance(self.sink, FileSink) else None
        return {"bytes": self.size, "block": self.block, ALGO: self.crcs}

    def _give_back(self) -> None:
        if self._buf is not None:
            if isinstance(self.sink, ImageSink):
                self.sink.cache.append(self._buf)
            else:
                POOL.give(self._buf)
            self._buf = None

    def abort(self) -> None:
        self._give_back()
        self.sink.abort()
