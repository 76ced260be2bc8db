"""sum_squares against a float64 torch reference on every ISA path, and the Inf/NaN flag."""
import math

import pytest
import torch

from zerocore import ops
from zerocore.ops.reference import sum_squares_reference

from conftest import SIZES


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sum_squares_matches_reference(forced_isa, n, dtype):
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3).to(dtype)
    got, bad = ops.sum_squares(x)
    want, want_bad = sum_squares_reference(x)
    assert not bad and not want_bad
    assert math.isclose(got, want, rel_tol=1e-12)


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", [0, 1000, 2**20 + 2])
def test_nonfinite_flag(forced_isa, value, where):
    x = torch.randn(2**20 + 3)
    x[where] = value
    assert ops.sum_squares(x)[1]
    assert ops.sum_squares(x.bfloat16())[1]


def test_large_finite_values_do_not_flag():
    """Squares of fp32 max are huge but finite in double: no false overflow."""
    x = torch.full((1000,), 3.0e38)
    got, bad = ops.sum_squares(x)
    assert not bad and math.isclose(got, 1000 * 3.0e38 ** 2, rel_tol=1e-6)


def test_empty():
    assert ops.sum_squares(torch.empty(0)) == (0.0, False)
