"""ops.crc32c against a bit-by-bit Python CRC32C on odd sizes and offsets, the SSE4.2 path (three
interleaved streams above 12 KiB) against the table path, chaining, ops.copy_crc32c (the copy and
the checksum in one pass), and bad arguments."""
import pytest
import torch

from zerocore import ops
from zerocore.ops import _loader
from zerocore.ops.reference import crc32c_reference


def test_known_values():
    assert ops.crc32c(torch.tensor(list(b"123456789"), dtype=torch.uint8)) == 0xE3069283  # the standard check value
    assert ops.crc32c(torch.zeros(32, dtype=torch.uint8)) == 0x8A9136AA  # RFC 3720 test vector
    assert ops.crc32c(torch.empty(0)) == 0


@pytest.mark.parametrize("n", [1, 3, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000, 4099])
def test_matches_reference_at_odd_sizes_and_offsets(n):
    gen = torch.Generator().manual_seed(n)
    buf = torch.randint(0, 256, (n + 11,), generator=gen, dtype=torch.uint8)
    for start in (0, 1, 3, 5):
        view = buf[start:start + n]
        want = crc32c_reference(bytes(view.tolist()))
        assert ops.crc32c(view) == want
        assert _loader.load().crc32c(view, 0, False) == want  # the table path too


def test_hardware_and_table_paths_agree_and_chain():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(250_003, generator=gen)  # any dtype: its bytes
    lib = _loader.load()
    whole = ops.crc32c(x)
    assert whole == lib.crc32c(x, 0, False) == lib.crc32c(x.view(torch.uint8), 0, True)
    a, b = x[:100_001], x[100_001:]
    assert ops.crc32c(b, ops.crc32c(a)) == whole
    y = x.clone()
    y.view(torch.uint8)[12345] ^= 1  # one flipped bit changes it
    assert ops.crc32c(y) != whole


@pytest.mark.parametrize("n", [0, 5, 12287, 12288, 12289, 12295, 1 << 20, (1 << 20) + 13])
def test_three_streams_and_copy_match_the_table(n):
    gen = torch.Generator().manual_seed(n)
    src = torch.randint(0, 256, (n + 3,), generator=gen, dtype=torch.uint8)[3:]  # unaligned too
    lib = _loader.load()
    want = lib.crc32c(src, 0, False)
    assert ops.crc32c(src) == want
    dst = torch.zeros(n, dtype=torch.uint8)
    assert ops.copy_crc32c(src, dst) == want and torch.equal(dst, src)
    if n > 7:  # continued from a previous piece
        k = n // 3
        first = ops.crc32c(src[:k])
        rest = torch.empty(n - k, dtype=torch.uint8)
        assert ops.copy_crc32c(src[k:], rest, first) == want


def test_copy_crc32c_bad_arguments():
    with pytest.raises(ValueError, match="'dst' has 3 bytes, 'src' 4"):
        ops.copy_crc32c(torch.zeros(4, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8))
    x = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="overlap"):
        ops.copy_crc32c(x[:4], x[2:6])
    with pytest.raises(ValueError, match="contiguous"):
        ops.copy_crc32c(torch.zeros(4, 2)[:, 0], torch.zeros(4))


@pytest.mark.parametrize("call, exc, words", [
    (lambda: ops.crc32c([1, 2]), TypeError, "'tensor' must be a torch.Tensor"),
    (lambda: ops.crc32c(torch.zeros(4, 2)[:, 0]), ValueError, "contiguous"),
    (lambda: ops.crc32c(torch.zeros(4, device="meta")), ValueError, "host memory"),
    (lambda: ops.crc32c(torch.zeros(4), 2**32), ValueError, "'crc' must be <="),
    (lambda: ops.crc32c(torch.zeros(4), -1), ValueError, "'crc' must be >= 0"),
    (lambda: ops.crc32c(torch.zeros(4), 1.5), TypeError, "'crc' must be an integer"),
])
def test_bad_arguments(call, exc, words):
    with pytest.raises(exc, match=words):
        call()
