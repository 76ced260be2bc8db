"""One tile of swapped optimizer state on disk: a 4096-byte header, then the tile's fp32 master,
m and v, each padded to 4096 bytes, so one O_DIRECT transfer moves a whole tile and its proof.
A stage-3 parameter shard swapped to NVMe is the same header and one padded array of the
training dtype (``ParamRecord``).

The header names what the record must be (run id, rank, group, tile, commit number, elements)
and carries a checksum of the header fields and the payload: CRC32C by ``ops.crc32c`` (the
SSE4.2 instruction on three interleaved streams, the same checksum checkpoints use; faster here
than the ``crc32c`` package), the algorithm named in the header (records of zlib's CRC32,
algorithm 1, are still verified). A read is accepted only if every field
is the one expected: bytes of another run (a crashed run's leftovers), of another tile, of an
older commit (a lost write), short (a truncated file) or flipped are refused with an error that
names the file, the byte offset and the step, before any of it is used.
"""
from __future__ import annotations

import struct
import zlib

import torch

from ... import ops

HEADER = 4096
ALIGN_ELEMS = 1024  # fp32 elements per 4096 bytes
MAGIC = b"ZCSWAP01"
# magic, run id (32 ascii), rank, group, tile, commit, elements, payload bytes, checksum algorithm, checksum
_FMT = struct.Struct("<8s32sIIIQQQII")


def _as_tensor(data) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        return data
    if hasattr(data, "__array_interface__"):  # a numpy array
        return torch.from_numpy(data.reshape(-1)).view(torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)


def _crc32c(data, crc: int = 0) -> int:
    return ops.crc32c(_as_tensor(data), crc)


def _crc32(data, crc: int = 0) -> int:
    return zlib.crc32(data.numpy() if isinstance(data, torch.Tensor) else data, crc)


CHECKSUMS = {1: ("crc32", _crc32), 2: ("crc32c", _crc32c)}
ALGO = 2


class SwapError(RuntimeError):
    """An NVMe swap file could not be written or read back as it was written."""


class SwapCorruptError(SwapError):
    """A swap record read back does not match what was written (checksum, length or identity)."""


def padded(n: int) -> int:
    return -(-max(n, 1) // ALIGN_ELEMS) * ALIGN_ELEMS


def record_bytes(tile: int) -> int:
    """Bytes of one record of a ``tile``-element tile (header + three padded fp32 arrays)."""
    return HEADER + 3 * 4 * padded(tile)


class Record:
    """Views of one record laid out in an aligned uint8 buffer (the buffer is reused per tile)."""

    checksum = True  # benchmarks/offload_io.py switches it off to measure what the CRC costs

    def __init__(self, buf: torch.Tensor, tile: int):
        self.tile = tile
        self.nbytes = record_bytes(tile)
        self.raw = buf[:self.nbytes]
        p = padded(tile)
        body = self.raw[HEADER:].view(torch.float32)
        self.master, self.exp_avg, self.exp_avg_sq = body[:p], body[p:2 * p], body[2 * p:3 * p]
        self._np = self.raw.numpy()

    def arrays(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.master[:n], self.exp_avg[:n], self.exp_avg_sq[:n]

    def _crc(self, fields: bytes, algo: int | None = None) -> int:
        if not self.checksum:
            return 0
        fn = CHECKSUMS[ALGO if algo is None else algo][1]
        return fn(fields, fn(self.raw[HEADER:]))

    def seal(self, run: str, rank: int, group: int, tile: int, commit: int, n: int) -> None:
        """Writes the header for the payload now in the buffer."""
        fields = _FMT.pack(MAGIC, run.encode(), rank, group, tile, commit, n, self.nbytes - HEADER, ALGO, 0)[:-4]
        crc = self._crc(fields)
        head = _FMT.pack(MAGIC, run.encode(), rank, group, tile, commit, n, self.nbytes - HEADER, ALGO, crc)
        self._np[:HEADER] = 0
        self._np[:len(head)] = bytearray(head)

    def verify(self, expect: dict, where: str) -> None:
        """Raises SwapCorruptError (naming ``where``) unless the buffer holds the expected record."""
        head = bytes(self._np[:_FMT.size])
        magic, run, rank, group, tile, commit, n, body, algo, crc = _FMT.unpack(head)
        got = {"run": run.rstrip(b"\0").decode(errors="replace"), "rank": rank, "group": group, "tile": tile,
               "commit": commit, "elements": n, "payload bytes": body}
        if magic != MAGIC:
            raise SwapCorruptError(f"zerocore nvme: {where}: not a zerocore swap record (bad magic {magic!r}); the "
                                   "file was overwritten, truncated or never written. Nothing was changed")
        for key, want in expect.items():
            if got[key] != want:
                raise SwapCorruptError(f"zerocore nvme: {where}: record {key} is {got[key]!r}, expected {want!r} "
                                       "(a stale, foreign or misplaced record). Nothing was changed")
        if algo not in CHECKSUMS:
            raise SwapCorruptError(f"zerocore nvme: {where}: unknown checksum algorithm {algo} in the record header "
                                   f"(known here: {sorted(CHECKSUMS)}). Nothing was changed")
        if self.checksum and crc != self._crc(head[:-4], algo):
            raise SwapCorruptError(f"zerocore nvme: {where}: checksum mismatch ({CHECKSUMS[algo][0]} of {self.nbytes} "
                                   "bytes): the data on disk is not what was written. Nothing was changed")


def param_record_bytes(n: int, dtype: torch.dtype) -> int:
    """Bytes of one record of an ``n``-element parameter shard (header + the shard padded to 4096)."""
    return HEADER + -(-max(n, 1) * torch.empty(0, dtype=dtype).element_size() // HEADER) * HEADER


class ParamRecord(Record):
    """One group's parameter shard (``values``, ``n`` elements of ``dtype``) in an aligned buffer;
    sealed and verified as Record's (the header's tile field is 0)."""

    def __init__(self, buf: torch.Tensor, n: int, dtype: torch.dtype):
        self.tile = n
        self.nbytes = param_record_bytes(n, dtype)
        self.raw = buf[:self.nbytes]
        self.values = self.raw[HEADER:].view(dtype)[:n]
        self._np = self.raw.numpy()
