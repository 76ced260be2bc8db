"""Files written in fixed-size blocks with a CRC32C per block, and read back verified.

A checksum per block (not per file) is what lets a rank read only the byte ranges it needs and
still verify every byte it uses: it reads the blocks that cover its ranges and checks each.

The bytes move between the caller's tensors and the disk through 4096-aligned I/O buffers (the
memory O_DIRECT wants), taken from pools shared by both sides (:data:`POOL`, :data:`HANDLES`).
Writing is ``block_writer.py``. A read fetches whole blocks into aligned buffers, several requests
in flight through ``zerocore.ops.AsyncIO``, and verifies every block in place (the CRC of one
buffer runs while the next ones are being read) before any byte is handed out. Without AsyncIO
(not built, or the config turns O_DIRECT off) the same buffers go through ``preadv`` and the page
cache.

CRC32C (``ops.crc32c``, the instruction on three interleaved streams) is the project's one
checksum for checkpoints and NVMe swap records; files of checkpoints written before it carry
zlib's CRC-32 (``"crc32"`` in the manifest) and are still verified with it.
"""
from __future__ import annotations

import atexit
import bisect
import contextlib
import ctypes
import os
import threading
import zlib

import torch

from .. import ops
from ..comm import lifetime
from .staging import ALIGN, padded

BLOCK_BYTES = 1 << 20
IO_BYTES = 16 << 20  # one I/O buffer; a multiple of BLOCK_BYTES, so every buffer holds whole blocks
RING = 3  # buffers in flight per writer or reader
ALGO = "crc32c"  # what new files are checksummed with (the manifest's key for the list of CRCs)


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable buffer (no copy, no numpy); the
    caller keeps ``t`` alive while the view is used."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor on its device (a view where ``t`` is contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def _native():
    """The extension's checksum functions, called directly in the loops over blocks (their
    arguments are built here, and the native side checks them again)."""
    global _NATIVE
    if _NATIVE is None:
        ops.crc32c(torch.empty(0, dtype=torch.uint8))  # loads the extension, or raises saying why not
        from ..ops import _loader

        _NATIVE = _loader.load("checksum")
    return _NATIVE


_NATIVE = None


def checksum(algo: str, data: torch.Tensor, crc: int = 0) -> int:
    """The checksum ``algo`` ("crc32c", or "crc32" of older checkpoints) of a host uint8 tensor."""
    if algo == "crc32c":
        return _native().crc32c(data, crc, True)
    return zlib.crc32(byte_view(data), crc)


class ChecksumError(IOError):
    """A file of a checkpoint does not match what its manifest records."""


class BufferPool:
    """Aligned I/O buffers, reused: fresh memory costs page faults (on this project's machine
    more CPU than checksumming it), so a process keeps up to ``keep`` of each size."""

    def __init__(self, keep: int = RING + 3):
        self.keep = keep
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int = IO_BYTES) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        return ops.aligned_pinned_empty(nbytes, torch.uint8, lock=False)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            free = self._free.setdefault(buf.numel(), [])
            if len(free) < self.keep:
                free.append(buf)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


POOL = BufferPool()


class HandlePool:
    """AsyncIO handles kept between uses, by settings: making one probes the backends and starts
    worker threads, closing one joins them, which costs more than a checkpoint's checksums."""

    def __init__(self, keep: int = 2 * RING):
        self.keep = keep
        self._free: dict[str, list] = {}
        self._lock = threading.Lock()

    def take(self, settings: dict | None, n: int) -> list:
        """``n`` handles from the config's ``aio`` section, or ``n`` Nones (the page cache) where
        there is no setting or no engine."""
        if settings is None:
            return [None] * n
        from ..ops import aio

        if aio.aio_unavailable() is not None:
            return [None] * n
        key = repr(sorted(settings.items()))
        with self._lock:
            free = self._free.setdefault(key, [])
            out = [free.pop() for _ in range(min(n, len(free)))]
        try:
            while len(out) < n:
                extra = {"backend": out[0].backend} if out else {}  # probe the backends once
                out.append(aio.AsyncIO.from_config(settings, **extra))
        except OSError:
            self.give(settings, out)
            return [None] * n
        for h in out:
            h._zc_pool_key = key
        return out

    def give(self, settings, handles: list) -> None:
        """Back to the pool (what they had in flight is waited for, errors dropped)."""
        for h in handles:
            if h is None:
                continue
            try:
                h.wait()
            except OSError:
                pass
            key = getattr(h, "_zc_pool_key", None)
            with self._lock:
                free = self._free.setdefault(key, [])
                if key is not None and len(free) < self.keep:
                    free.append(h)
                    continue
            h.close()


    def close_all(self) -> None:
        with self._lock:
            handles = [h for free in self._free.values() for h in free]
            self._free.clear()
        for h in handles:
            h.close()


HANDLES = HandlePool()
atexit.register(HANDLES.close_all)  # their worker threads stop before the interpreter does
# both pools are emptied once no engine is left: a process done with zerocore holds none of their memory
lifetime.note_cache(POOL.clear)
lifetime.note_cache(HANDLES.close_all)


def aio_handles(settings: dict | None, n: int) -> list:
    return HANDLES.take(settings, n)


def _wait_quietly(handles: list) -> None:
    """Waits out every read still in flight before its buffer is reused or freed; the error that
    stopped the caller is the one reported, so a second failure here is not raised over it."""
    for h in handles:
        if h is not None:
            try:
                h.wait()
            except OSError:
                pass


def _close_handles(handles: list) -> None:
    HANDLES.give(None, handles)


# -- reading ------------------------------------------------------------------------------------------
class BlockFile:
    """One checkpoint file as its manifest records it: its presence and size are checked when it
    is opened (before any byte is used), each block's checksum when a fetch reads it."""

    def __init__(self, path: str, record: dict):
        self.path = path
        self.size = record["bytes"]
        self.block = record["block"]
        self.algo = ALGO if ALGO in record else "crc32"
        self.crcs = record[self.algo]
        try:
            actual = os.path.getsize(path)
        except FileNotFoundError:
            raise ChecksumError(f"zerocore checkpoint: file {path} is missing (the manifest lists it)") from None
        if actual != self.size:
            raise ChecksumError(f"zerocore checkpoint: file {path} has {actual} bytes; the manifest records "
                                f"{self.size} (truncated or replaced)")
        if len(self.crcs) != -(-self.size // self.block):
            raise ChecksumError(f"zerocore checkpoint: the manifest records {len(self.crcs)} checksums for "
                                f"{path} ({self.size} bytes in blocks of {self.block}); the manifest is corrupt")

    def check_range(self, offset: int, nbytes: int) -> None:
        """Bytes [offset, offset + nbytes) lie inside the file (the manifest's offsets are data)."""
        if offset < 0 or offset + nbytes > self.size:
            raise ChecksumError(f"zerocore checkpoint: the manifest points past the end of {self.path} "
                                f"(bytes {offset}-{offset + nbytes} of {self.size})")

    def verify(self, first_block: int, data: torch.Tensor) -> None:
        """Checks the whole blocks held in ``data`` (uint8, starting at block ``first_block``)."""
        for i in range(0, data.numel(), self.block):
            b = first_block + i // self.block
            if checksum(self.algo, data[i:i + self.block]) != self.crcs[b]:
                lo = b * self.block
                raise ChecksumError(f"zerocore checkpoint: file {self.path} is corrupt: bytes "
                                    f"{lo}-{min(lo + self.block, self.size)} do not match the checksum in the manifest")


class Fetch:
    """The bytes of a set of ranges of checkpoint files, read whole-block into aligned buffers
    (only the blocks that cover the ranges; adjacent ones in one request), ``RING`` buffers in
    flight, every block verified before :meth:`copy_into` hands out any byte of it.

        f = Fetch(files, aio); f.add(name, offset, nbytes); ...; f.run(); f.copy_into(name, offset, out)
    """

    def __init__(self, files: dict[str, BlockFile], handles: list, piece_bytes: int = IO_BYTES):
        """``handles``: ``RING`` AsyncIO handles (or Nones: the page cache), owned by the caller."""
        self.files = files
        self.handles = handles
        self.piece_bytes = piece_bytes  # bytes per buffer (and per request)
        self._wants: dict[str, list[tuple[int, int]]] = {}
        self._pieces: dict[str, tuple[list[int], list[tuple[int, torch.Tensor]]]] = {}
        self._arena = None  # where run() put the bytes when it was given one (not the pool's buffers)

    def add(self, name: str, offset: int, nbytes: int) -> None:
        f = self.files[name]
        f.check_range(offset, nbytes)
        if nbytes:
            self._wants.setdefault(name, []).append((offset // f.block, (offset + nbytes - 1) // f.block))

    def _plan(self) -> list[tuple[str, int, int]]:
        """(file, first byte, bytes) of every read: runs of needed blocks cut into pieces."""
        reads = []
        for name, spans in self._wants.items():
            f = self.files[name]
            runs: list[list[int]] = []
            for b0, b1 in sorted(spans):
                if runs and b0 <= runs[-1][1] + 1:
                    runs[-1][1] = max(runs[-1][1], b1)
                else:
                    runs.append([b0, b1])
            step = max(f.block, self.piece_bytes // f.block * f.block)
            for b0, b1 in runs:
                lo, hi = b0 * f.block, min((b1 + 1) * f.block, f.size)
                reads.extend((name, a, min(hi, a + step)) for a in range(lo, hi, step))
        return reads

    def planned_reads(self) -> list[int]:
        """The bytes of each read :meth:`run` makes for what was added (whole blocks)."""
        return [b - a for _, a, b in self._plan()]

    def planned_bytes(self) -> int:
        """The bytes :meth:`run` reads for what was added (whole blocks), each read's start
        aligned: what an arena for ``run(arena=...)`` must hold."""
        return sum(padded(b - a) for _, a, b in self._plan())

    def run(self, keep: bool = True, arena=None) -> None:
        """Reads and verifies everything added (raises ChecksumError naming the file and bytes);
        ``keep=False``: only verifies (each buffer goes back to the pool once checked);
        ``arena`` (a ``staging.Arena`` of :meth:`planned_bytes`): the bytes are read into it and
        kept there, every block read once."""
        reads = self._plan()
        bufs = [None] * len(reads)
        self._arena = arena

        def take(i: int) -> torch.Tensor:
            n = reads[i][2] - reads[i][1]
            bufs[i] = arena.take(n) if arena is not None else _take(n, self.piece_bytes)
            return bufs[i]

        try:
            with contextlib.closing(_verified_reads(self.files, self.handles, reads, take)) as ring:
                for i, _ in ring:
                    name, a, b = reads[i]
                    if keep:
                        starts, pieces = self._pieces.setdefault(name, ([], []))
                        starts.append(a)
                        pieces.append((b, bufs[i]))
                    else:
                        _give(bufs[i], self.piece_bytes)
                        bufs[i] = None
        except BaseException:
            held = {id(buf) for _, pieces in self._pieces.values() for _, buf in pieces}
            for buf in bufs:
                if buf is not None and id(buf) not in held and arena is None:
                    _give(buf, self.piece_bytes)
            self.release()
            raise

    def copy_into(self, name: str, offset: int, out: torch.Tensor) -> None:
        """Fills ``out`` (a contiguous CPU tensor, any dtype) with the file's verified bytes from
        ``offset``."""
        dst = as_bytes(out)
        starts, pieces = self._pieces[name]
        pos, end = offset, offset + dst.numel()
        i = bisect.bisect_right(starts, pos) - 1
        while pos < end:
            if i < 0 or i >= len(starts) or not starts[i] <= pos < pieces[i][0]:
                raise KeyError(f"bytes {pos}-{end} of {name} were not fetched")
            a, (b, buf) = starts[i], pieces[i]
            stop = min(end, b)
            dst[pos - offset:stop - offset].copy_(buf[pos - a:stop - a])
            pos = stop
            i += 1

    def tensor(self, name: str, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(nbytes // torch.empty(0, dtype=dtype).element_size(), dtype=dtype)
        self.copy_into(name, offset, out)
        return out

    def release(self) -> None:
        if self._arena is None:
            for _, pieces in self._pieces.values():
                for _, buf in pieces:
                    _give(buf, self.piece_bytes)
        else:
            self._arena.free()
            self._arena = None
        self._pieces.clear()


def read_into(files: dict[str, BlockFile], handles: list, targets: list[tuple[str, int, torch.Tensor]],
              piece_bytes: int = IO_BYTES) -> None:
    """Fills every target (file, byte offset, ``dst``: a contiguous CPU uint8 tensor) with the
    file's bytes from that offset, every block verified. Where ``dst``'s memory lines up with the
    file's pages (its address and the offset agree modulo 4096), the whole blocks inside the range
    are read by O_DIRECT straight into ``dst`` and verified there: no copy and no other memory.
    The partial blocks at a range's two ends, and every block of a range that does not line up,
    are read into pooled buffers (once, where two ranges share a block), verified, and copied.
    Raises ChecksumError naming the file and bytes; the targets then hold partial contents."""
    edges = Fetch(files, handles, piece_bytes)
    copies, direct = [], []  # (file, offset, dst) copied from ``edges``; (file, first byte, end, dst) read in place
    page_cache = handles[0] is None  # preadv copies from the page cache into any memory
    for name, off, dst in targets:
        f, n = files[name], dst.numel()
        f.check_range(off, n)
        a = -(-off // f.block) * f.block  # the whole blocks inside [off, off + n): [a, b)
        b = (off + n) // f.block * f.block
        if a < b and (page_cache or (f.block % ALIGN == 0 and (dst.data_ptr() + a - off) % ALIGN == 0)):
            direct.append((name, a, b, dst[a - off:b - off]))
            copies += [(name, off, dst[:a - off]), (name, b, dst[b - off:])]
        else:
            copies.append((name, off, dst))
    copies = [c for c in copies if c[2].numel()]
    for name, off, dst in copies:
        edges.add(name, off, dst.numel())
    edges.run()
    try:
        for name, off, dst in copies:
            edges.copy_into(name, off, dst)
    finally:
        edges.release()
    reads = []  # requests of at most piece_bytes, whole blocks: (file, first byte, end, dst)
    for name, a, b, dst in sorted(direct, key=lambda d: (d[0], d[1])):
        step = max(files[name].block, piece_bytes // files[name].block * files[name].block)
        reads += [(name, x, min(b, x + step), dst[x - a:min(b, x + step) - a]) for x in range(a, b, step)]
    with contextlib.closing(_verified_reads(files, handles, [r[:3] for r in reads], lambda i: reads[i][3])) as ring:
        for _ in ring:  # each verified where it landed
            pass


def stream(files: dict[str, BlockFile], handles: list, ranges: list[tuple[str, int, int]],
           piece_bytes: int = IO_BYTES):
    """The verified bytes of ``ranges`` ((file, byte offset, bytes), any files, any order),
    yielded as uint8 views in exactly that order: each range is read whole-block in pieces of
    ``piece_bytes``, ``RING`` reads in flight while the caller uses the view it was given. A
    view is valid until the caller asks for the next one (its buffer then goes back to the
    pool): the consumer writes or converts it in between, its work overlapping the reads."""
    reads = []  # (file, first byte read, end, first byte wanted, end wanted)
    for name, off, n in ranges:
        f = files[name]
        f.check_range(off, n)
        step = max(f.block, piece_bytes // f.block * f.block)
        lo, end = off // f.block * f.block, off + n
        for a in range(lo, end, step):
            b = min(a + step, -(-end // f.block) * f.block, f.size)
            reads.append((name, a, b, max(a, off), min(b, end)))
    bufs: list = [None] * len(reads)

    def take(i: int) -> torch.Tensor:
        bufs[i] = _take(reads[i][2] - reads[i][1], piece_bytes)
        return bufs[i]

    try:
        with contextlib.closing(_verified_reads(files, handles, [r[:3] for r in reads], take)) as ring:
            for i, _ in ring:
                _, a, _, x, y = reads[i]
                yield bufs[i][x - a:y - a]
                _give(bufs[i], piece_bytes)
                bufs[i] = None
    finally:
        for buf in bufs:
            if buf is not None:
                _give(buf, piece_bytes)


def _verified_reads(files: dict[str, BlockFile], handles: list, reads: list[tuple[str, int, int]], take):
    """The one read loop of every reader here: each read (file, first byte, end: whole blocks) into
    ``take(i)`` (uint8 memory of at least its bytes), ``RING`` in flight, read i through
    ``handles[i % RING]`` (AsyncIO, or the page cache where it is None). Yields (i, its bytes) once
    every block of read i is verified; read i + RING starts when the caller asks for the next, so
    the caller may reuse what it was given. However it ends (an error, the caller closing it), no
    read is still in flight into the caller's memory and the files it opened are closed."""
    fds: dict[str, int] = {}
    data: dict[int, torch.Tensor] = {}

    def start(i: int) -> None:
        name, a, b = reads[i]
        buf = data[i] = take(i)[:b - a]
        h = handles[i % RING]
        if h is not None:
            h.async_pread(buf, files[name].path, a)
        else:
            if name not in fds:
                fds[name] = os.open(files[name].path, os.O_RDONLY)
            _pread_all(fds[name], byte_view(buf), a, files[name])

    try:
        for i in range(min(RING, len(reads))):
            start(i)
        for i, (name, a, _) in enumerate(reads):
            if handles[i % RING] is not None:
                handles[i % RING].wait()
            f = files[name]
            f.verify(a // f.block, data[i])  # while the next RING - 1 reads proceed
            yield i, data.pop(i)
            if i + RING < len(reads):
                start(i + RING)
    finally:
        _wait_quietly(handles)
        for fd in fds.values():
            os.close(fd)


def _take(nbytes: int, piece_bytes: int) -> torch.Tensor:
    return POOL.take(piece_bytes) if nbytes <= piece_bytes else ops.aligned_pinned_empty(nbytes, torch.uint8,
                                                                                         lock=False)


def _give(buf: torch.Tensor, piece_bytes: int) -> None:
    if buf.numel() == piece_bytes:
        POOL.give(buf)


def _pread_all(fd: int, out: memoryview, offset: int, f: BlockFile) -> None:
    got = 0
    while got < len(out):
        n = os.preadv(fd, [out[got:]], offset + got)
        if n == 0:
            raise ChecksumError(f"zerocore checkpoint: file {f.path} ended at byte {offset + got} "
                                f"(the manifest records {f.size})")
        got += n
