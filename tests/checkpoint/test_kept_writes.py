"""``BlockWriter.write(t, kept=True)``: a host tensor that stays unchanged until the file is closed
goes to disk from its own memory (O_DIRECT where the engine has it, else ``pwrite``), placed at the
file offset whose remainder modulo 4096 matches its address. Every byte must land where the
returned offset says, every block's checksum must hold (the padding included), and the only bytes
copied are the partial pages at the tensor's two ends."""
from __future__ import annotations

import pytest
import torch

from zerocore.checkpoint import block_writer, blockio
from zerocore.ops import aio

BLOCK = 4096 * 4


def _sinks():
    yield "page cache", None
    if aio.aio_unavailable() is None:
        yield "O_DIRECT", {}


class _CountingNative:
    """The checksum functions, counting the bytes copied by ``copy_crc32c``."""

    def __init__(self, inner):
        self.inner = inner
        self.copied = 0

    def crc32c(self, *a):
        return self.inner.crc32c(*a)

    def copy_crc32c(self, src, dst, crc):
        self.copied += src.numel()
        return self.inner.copy_crc32c(src, dst, crc)


def _odd_view(n: int, shift: int, gen) -> torch.Tensor:
    """``n`` random bytes starting ``shift`` bytes past a fresh allocation (any address residue)."""
    return torch.randint(0, 256, (n + shift,), dtype=torch.uint8, generator=gen)[shift:]


@pytest.mark.parametrize("name,settings", list(_sinks()))
def test_kept_tensors_are_written_in_place_and_read_back_verified(tmp_path, monkeypatch, name, settings):
    monkeypatch.setattr(block_writer, "KEPT_MIN_BYTES", 3 * 4096)
    counting = _CountingNative(blockio._native())
    monkeypatch.setattr(blockio, "_NATIVE", counting)
    gen = torch.Generator().manual_seed(1)
    parts = [  # (tensor, kept)
        (_odd_view(100, 0, gen), False),  # leaves the file at an odd offset
        (_odd_view(5 * 4096 + 17, 64, gen), True),  # torch's usual residue
        (_odd_view(3 * 4096, 0, gen), True),  # page-aligned, whole pages
        (_odd_view(7, 0, gen), False),
        (_odd_view(9 * 4096 + 4095, 4095, gen), True),
        (_odd_view(2 * 4096, 1, gen), True),  # straddles: the body is one page
        (_odd_view(4096 * 3 - 1, 0, gen), False),
        (_odd_view(4096, 7, gen), True),  # under KEPT_MIN_BYTES: copied
        (torch.randn(3001, generator=gen).view(torch.uint8), True),  # a float tensor's bytes
    ]
    path = str(tmp_path / "f.bin")
    w = block_writer.BlockWriter(block_writer.FileSink(path, settings), block=BLOCK, io_bytes=2 * BLOCK)
    offsets = [w.write(t, kept=k) for t, k in parts]
    record = w.close()
    copied_kept = counting.copied - sum(t.numel() for t, k in parts if not k or t.numel() < 3 * 4096)
    # what a kept tensor costs in copies: its partial first and last pages, and the zeros before it
    assert copied_kept <= sum(3 * 4096 for t, k in parts if k and t.numel() >= 3 * 4096)
    assert offsets == sorted(offsets) and offsets[0] == 0
    for (t, k), off in zip(parts, offsets):
        if k and t.numel() >= 3 * 4096:
            assert off % 4096 == t.data_ptr() % 4096, "a kept tensor's pages line up with the file's"
    f = blockio.BlockFile(path, record)
    data = torch.from_file(path, size=record["bytes"], dtype=torch.uint8)
    f.verify(0, data)  # every block, the padding included
    for (t, _), off in zip(parts, offsets):
        assert torch.equal(data[off:off + t.numel()], t)
    fetch = blockio.Fetch({"f": f}, [None] * blockio.RING)
    for (t, _), off in zip(parts, offsets):
        fetch.add("f", off, t.numel())
    fetch.run()
    try:
        for (t, _), off in zip(parts, offsets):
            out = torch.empty_like(t)
            fetch.copy_into("f", off, out)
            assert torch.equal(out, t)
    finally:
        fetch.release()


def test_an_image_sink_copies_even_kept_tensors(tmp_path):
    """An asynchronous save's image is a snapshot: the state changes after the call returns."""
    cache: list = []
    sink = block_writer.ImageSink(cache)
    w = block_writer.BlockWriter(sink, block=BLOCK, io_bytes=2 * BLOCK)
    t = torch.arange(3 * BLOCK, dtype=torch.uint8)
    w.write(t, kept=True)
    record = w.close()
    t.zero_()
    sink.write_file(str(tmp_path / "img.bin"), None)
    got = torch.from_file(str(tmp_path / "img.bin"), size=record["bytes"], dtype=torch.uint8)
    assert torch.equal(got, torch.arange(3 * BLOCK, dtype=torch.uint8))
