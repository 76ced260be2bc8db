"""cast against torch's own conversions on every ISA path: round-to-nearest-even for finite
values (bit-exact), Inf kept, NaN kept NaN; the destination is poisoned first."""
import pytest
import torch

from zerocore import ops

from conftest import SIZES

PAIRS = [(torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.bfloat16, torch.float32),
         (torch.float16, torch.float32), (torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)]


def _nasty(n, gen):
    """Random values across many exponents with the awkward cases mixed in."""
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-30, 30, (n,), generator=gen).float())
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 65504.0, 65519.0, 65520.0,
                            6.1035156e-05, 5.9604645e-08, 2.9802322e-08, 3.3895314e38, 1e-40, 1.00390625])
    k = min(n, special.numel())
    x[:k] = special[:k]
    return x


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("src_dtype, dst_dtype", PAIRS)
def test_cast_matches_torch(forced_isa, n, src_dtype, dst_dtype):
    gen = torch.Generator().manual_seed(n)
    src = _nasty(n, gen).to(src_dtype)
    dst = torch.empty(n, dtype=dst_dtype)
    _bits(dst).fill_(0x5A5A)  # poison
    ops.cast(src, dst)
    want = src.to(dst_dtype)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(dst), nan)
    assert torch.equal(_bits(dst)[~nan], _bits(want)[~nan])


def test_cast_allocates_when_given_dtype():
    x = torch.randn(33)
    assert torch.equal(ops.cast(x, dtype=torch.bfloat16), x.bfloat16())


def test_cast_errors():
    with pytest.raises(ValueError, match="'dst' has 4 elements"):
        ops.cast(torch.randn(5), torch.empty(4, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="'src' has dtype float64"):
        ops.cast(torch.randn(5, dtype=torch.float64), torch.empty(5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="needs 'dst' or 'dtype'"):
        ops.cast(torch.randn(5))
