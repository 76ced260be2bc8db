"""``blockio.read_into``: a checkpoint file's verified bytes straight into the caller's memory.
Ranges whose memory lines up with the file's pages are read by O_DIRECT in place (whole blocks,
verified there); their partial end blocks, and ranges that do not line up, through pooled
buffers, each shared block read once. Checked against the file's bytes for ranges at every kind
of offset and memory alignment, through AsyncIO and through the page cache, and a corrupt block
refused naming the file, whether it lies in an in-place block or in a copied edge."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from zerocore import ops
from zerocore.checkpoint import block_writer, blockio
from zerocore.config import AioConfig

BLOCK = 4096 * 4  # O_DIRECT wants blocks that are whole pages
PAGE = 4096


def _handles(how: str) -> list:
    if how == "page cache":
        return [None] * blockio.RING
    if ops.aio.aio_unavailable() is not None:
        pytest.skip(f"AsyncIO unavailable: {ops.aio.aio_unavailable()}")
    return blockio.aio_handles(dataclasses.asdict(AioConfig()), blockio.RING)


def _write(path: str, data: torch.Tensor) -> blockio.BlockFile:
    w = block_writer.BlockWriter(block_writer.FileSink(path, None), block=BLOCK, io_bytes=4 * BLOCK)
    w.write(data)
    return blockio.BlockFile(path, w.close())


def _targets(data_len: int):
    """(offset, bytes, memory's remainder modulo 4096 relative to the offset's): ranges with whole
    blocks inside and aligned memory (read in place), misaligned memory (copied), shorter than a
    block, starting and ending on block boundaries, reaching the file's last short block, and two
    ranges that share a block."""
    return [(0, 5 * BLOCK, 0), (3 * BLOCK + 100, 4 * BLOCK + 17, 0), (3 * BLOCK + 100, 4 * BLOCK, 64),
            (BLOCK - 8, 16, 0), (2 * BLOCK, 2 * BLOCK, 0), (9 * BLOCK + 5, data_len - 9 * BLOCK - 5, 0),
            (5 * BLOCK + 300, BLOCK, 0), (6 * BLOCK + 300, 2 * BLOCK, 0)]


def _dst(n: int, off: int, skew: int) -> torch.Tensor:
    """n bytes of memory whose address is ``off + skew`` modulo 4096."""
    buf = ops.aligned_pinned_empty(n + 2 * PAGE, torch.uint8, lock=False).fill_(0xEE)
    start = (off + skew) % PAGE
    return buf[start:start + n]


@pytest.mark.parametrize("how", ["aio", "page cache"])
def test_every_range_gets_the_files_bytes(tmp_path, how):
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (12 * BLOCK + 777,), dtype=torch.uint8, generator=gen)
    files = {"f": _write(str(tmp_path / "f"), data)}
    handles = _handles(how)
    try:
        targets = [("f", off, _dst(n, off, skew)) for off, n, skew in _targets(data.numel())]
        blockio.read_into(files, handles, targets, piece_bytes=2 * BLOCK)
        for _, off, dst in targets:
            assert torch.equal(dst, data[off:off + dst.numel()]), (off, dst.numel())
    finally:
        blockio._close_handles(handles)


@pytest.mark.parametrize("how", ["aio", "page cache"])
@pytest.mark.parametrize("where", [4 * BLOCK + 9, 3 * BLOCK + 150])  # inside an in-place block / in a copied edge
def test_a_corrupt_block_is_refused_naming_the_file(tmp_path, how, where):
    data = torch.arange(10 * BLOCK // 8, dtype=torch.int64).view(torch.uint8)
    path = str(tmp_path / "r")
    files = {"r": _write(path, data)}
    with open(path, "r+b") as fh:
        fh.seek(where)
        byte = fh.read(1)
        fh.seek(where)
        fh.write(bytes([byte[0] ^ 1]))
    lo = where // BLOCK * BLOCK
    handles = _handles(how)
    try:
        off = 3 * BLOCK + 100
        with pytest.raises(blockio.ChecksumError, match=f"{path} is corrupt: bytes {lo}-{lo + BLOCK}"):
            blockio.read_into(files, handles, [("r", off, _dst(4 * BLOCK, off, 0))], piece_bytes=BLOCK)
        assert all(h is None or h.pending == 0 for h in handles)  # nothing still lands in the memory
        with pytest.raises(blockio.ChecksumError, match="points past the end"):
            blockio.read_into(files, handles, [("r", 9 * BLOCK, _dst(2 * BLOCK, 0, 0))])
    finally:
        blockio._close_handles(handles)


@pytest.mark.parametrize("how", ["aio", "page cache"])
def test_lined_up_memory_is_read_in_place(tmp_path, monkeypatch, how):
    """Only the partial end blocks of a lined-up range are copied; a range that does not line up is
    copied whole through AsyncIO (O_DIRECT cannot read into it) and read in place through the page
    cache."""
    data = torch.randint(0, 256, (8 * BLOCK,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    files = {"f": _write(str(tmp_path / "f"), data)}
    copied = []
    real = blockio.Fetch.copy_into
    monkeypatch.setattr(blockio.Fetch, "copy_into", lambda self, name, off, out: (
        copied.append(out.numel()), real(self, name, off, out))[1])
    handles = _handles(how)
    try:
        for (off, n, skew), want in [((BLOCK + 10, 5 * BLOCK, 0), 5 * BLOCK - 4 * BLOCK),
                                     ((BLOCK + 10, 5 * BLOCK, 64), 5 * BLOCK if how == "aio" else BLOCK)]:
            copied.clear()
            dst = _dst(n, off, skew)
            blockio.read_into(files, handles, [("f", off, dst)])
            assert torch.equal(dst, data[off:off + n])
            assert sum(copied) == want, (skew, copied)
    finally:
        blockio._close_handles(handles)
