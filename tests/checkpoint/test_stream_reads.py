"""``blockio.stream``: the verified bytes of any ranges of checkpoint files, in the order asked,
pieces of at most ``piece_bytes`` (whole blocks read, several in flight), and a corrupt block
refused with the file and byte range named."""
from __future__ import annotations

import os

import pytest
import torch

from zerocore.checkpoint import block_writer, blockio

BLOCK = 4096


def _write(path: str, data: torch.Tensor) -> blockio.BlockFile:
    w = block_writer.BlockWriter(block_writer.FileSink(path, None), block=BLOCK, io_bytes=4 * BLOCK)
    w.write(data)
    return blockio.BlockFile(path, w.close())


@pytest.mark.parametrize("piece", [BLOCK, 3 * BLOCK, 1 << 20])
def test_ranges_come_back_in_the_order_asked(tmp_path, piece):
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, 256, (10 * BLOCK + 123,), dtype=torch.uint8, generator=gen)
    b = torch.randint(0, 256, (3 * BLOCK + 7,), dtype=torch.uint8, generator=gen)
    files = {"a": _write(str(tmp_path / "a"), a), "b": _write(str(tmp_path / "b"), b)}
    ranges = [("b", 5, 2 * BLOCK), ("a", 3 * BLOCK - 1, 4 * BLOCK + 2), ("a", 0, 10), ("b", 0, 0),
              ("a", 10 * BLOCK, 123), ("b", 3 * BLOCK, 7)]
    want = torch.cat([(a if f == "a" else b)[o:o + n] for f, o, n in ranges])
    got = torch.cat([v.clone() for v in blockio.stream(files, [None] * blockio.RING, ranges, piece)])
    assert torch.equal(got, want)


def test_a_corrupt_block_is_refused_naming_the_file(tmp_path):
    data = torch.arange(8 * BLOCK, dtype=torch.int64).view(torch.uint8)[:8 * BLOCK]
    f = _write(str(tmp_path / "r"), data)
    with open(tmp_path / "r", "r+b") as fh:
        fh.seek(5 * BLOCK + 17)
        byte = fh.read(1)
        fh.seek(5 * BLOCK + 17)
        fh.write(bytes([byte[0] ^ 1]))
    with pytest.raises(blockio.ChecksumError, match=f"{os.path.join(str(tmp_path), 'r')} is corrupt: bytes "
                                                      f"{5 * BLOCK}-{6 * BLOCK}"):
        for _ in blockio.stream({"r": f}, [None] * blockio.RING, [("r", 0, 8 * BLOCK)], 2 * BLOCK):
            pass
    # a range that does not touch the corrupt block reads fine
    got = torch.cat([v.clone() for v in blockio.stream({"r": f}, [None] * blockio.RING, [("r", 0, 5 * BLOCK)])])
    assert torch.equal(got, data[:5 * BLOCK])
