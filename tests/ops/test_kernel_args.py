"""Bad arguments to every op get the same TypeError/ValueError on the CPU path and on the CUDA
path (CUDA tensors stood in for by tests/fake_cuda.py), raised before any native call: the
CUDA path records none, the CPU path leaves every tensor as it was."""
from __future__ import annotations

import pytest
import torch

from zerocore import ops

from fake_cuda import fake, install_recorder

B16 = torch.bfloat16


def _make(device):
    if device == "cpu":
        return lambda *shape, dtype=torch.float32: torch.zeros(*shape, dtype=dtype)
    return lambda *shape, dtype=torch.float32: fake(*shape, dtype=dtype)


def _adam(t, n=10, **kw):
    args = [t(n), t(n), t(n), t(n)]
    return args, dict(lr=1e-3, step=1, **kw)


# Each case: (name, call(t) with t the tensor factory of the device, exception, message regex).
CASES = [
    # pack / unpack
    ("pack non-tensor", lambda t: ops.pack([1.0], [0], t(8)), TypeError, r"pack: 'tensors\[0\]' must be a torch.Tensor"),
    ("pack float offset", lambda t: ops.pack([t(2)], [1.5], t(8)), TypeError, r"'offsets\[0\]' must be an integer, got float 1.5"),
    ("pack float offset 1.0", lambda t: ops.pack([t(2)], [1.0], t(8)), TypeError, r"'offsets\[0\]' must be an integer"),
    ("pack bool offset", lambda t: ops.pack([t(2)], [True], t(8)), TypeError, r"'offsets\[0\]' must be an integer"),
    ("pack offset 2**63", lambda t: ops.pack([t(2)], [2**63], t(8)), ValueError, r"at offset 9223372036854775808 does not fit"),
    ("pack offset 2**63-1", lambda t: ops.pack([t(2)], [2**63 - 1], t(8)), ValueError, r"at offset 9223372036854775807 does not fit"),
    ("pack offset -1", lambda t: ops.pack([t(2)], [-1], t(8)), ValueError, "does not fit"),
    ("pack past the end", lambda t: ops.pack([t(7), t(697), t(1)], [5, 13, 1000], t(1000)), ValueError,
     r"pack: 'tensors\[2\]' with 1 elements at offset 1000 does not fit in 'flat' of 1000 elements"),
    ("pack overlap", lambda t: ops.pack([t(7), t(697)], [5, 10], t(1000)), ValueError,
     r"'tensors\[0\]' and 'tensors\[1\]' overlap in the flat buffer"),
    ("pack dtype", lambda t: ops.pack([t(4, dtype=torch.float64)], [0], t(8)), TypeError,
     r"'tensors\[0\]' has dtype float64; expected float32"),
    ("pack source is flat", lambda t: (lambda f: ops.pack([f[:3]], [5], f))(t(8)), ValueError,
     r"'flat' and 'tensors\[0\]' share memory"),
    ("pack counts", lambda t: ops.pack([t(4)], [0, 1], t(8)), ValueError, "got 1 tensors but 2 offsets"),
    ("pack offsets not a sequence", lambda t: ops.pack([t(4)], 0, t(8)), TypeError, "'offsets' must be a sequence"),
    ("pack non-contiguous", lambda t: ops.pack([t(4, 2)[:, 0]], [0], t(8)), ValueError, r"'tensors\[0\]' must be contiguous"),
    ("pack flat not a tensor", lambda t: ops.pack([t(4)], [0], [0.0] * 8), TypeError, "'flat' must be a torch.Tensor"),
    ("unpack float offset", lambda t: ops.unpack(t(8), [t(2)], [1.5]), TypeError, r"unpack: 'offsets\[0\]' must be an integer"),
    ("unpack into flat", lambda t: (lambda f: ops.unpack(f, [f[4:6]], [0]))(t(8)), ValueError, "share memory"),
    ("unpack destinations alias", lambda t: (lambda d: ops.unpack(t(8), [d[0:3], d[2:5]], [0, 3]))(t(6)), ValueError,
     r"'tensors\[0\]' and 'tensors\[1\]' share memory"),
    # sum_squares
    ("sum_squares list", lambda t: ops.sum_squares([1.0, 2.0]), TypeError, "sum_squares: 'tensor' must be a torch.Tensor, got list"),
    ("sum_squares int64", lambda t: ops.sum_squares(t(4, dtype=torch.int64)), TypeError, "'tensor' has dtype int64"),
    ("sum_squares strided", lambda t: ops.sum_squares(t(4, 2)[:, 0]), ValueError, "must be contiguous"),
    # cast
    ("cast overlap", lambda t: (lambda x: ops.cast(x, x.view(B16)[3:13]))(t(10)), ValueError, "'src' and 'dst' share memory"),
    ("cast dtype vs dst", lambda t: ops.cast(t(4), t(4, dtype=B16), dtype=torch.float16), ValueError,
     "dtype=float16 but 'dst' has dtype bfloat16"),
    ("cast dtype not a dtype", lambda t: ops.cast(t(4), dtype="bfloat16"), TypeError, "'dtype' must be a torch.dtype"),
    ("cast dtype float64", lambda t: ops.cast(t(4), dtype=torch.float64), TypeError, "'dtype' is float64"),
    ("cast sizes", lambda t: ops.cast(t(5), t(4, dtype=B16)), ValueError, "'dst' has 4 elements but 'src' has 5"),
    ("cast src dtype", lambda t: ops.cast(t(5, dtype=torch.float64), t(5, dtype=B16)), TypeError, "'src' has dtype float64"),
    ("cast nothing to cast to", lambda t: ops.cast(t(5)), ValueError, "needs 'dst' or 'dtype'"),
    ("cast src not a tensor", lambda t: ops.cast([1.0], t(1)), TypeError, "'src' must be a torch.Tensor"),
    # adam_step
    ("adam step 1.0", lambda t: (lambda a, k: ops.adam_step(*a, **{**k, "step": 1.0}))(*_adam(t)), ValueError, "step must be an int >= 1"),
    ("adam step True", lambda t: (lambda a, k: ops.adam_step(*a, **{**k, "step": True}))(*_adam(t)), ValueError, "step must be an int >= 1"),
    ("adam step 2**63", lambda t: (lambda a, k: ops.adam_step(*a, **{**k, "step": 2**63}))(*_adam(t)), ValueError, "step must be <="),
    ("adam grad is param", lambda t: (lambda p: ops.adam_step(p, p, t(10), t(10), lr=1e-3, step=1))(t(10)), ValueError,
     "adam_step: 'param' and 'grad' share memory"),
    ("adam grad size", lambda t: ops.adam_step(t(10), t(9), t(10), t(10), lr=1e-3, step=1), ValueError,
     "adam_step: 'grad' has 9 elements but 'param' has 10"),
    ("adam param_out fp32", lambda t: ops.adam_step(t(10), t(10), t(10), t(10), lr=1e-3, step=1, param_out=t(10)), TypeError,
     "'param_out' has dtype float32; expected bfloat16 or float16"),
    ("adam lr", lambda t: ops.adam_step(t(10), t(10), t(10), t(10), lr=float("nan"), step=1), ValueError, "lr must be finite"),
    # adam_step_multi
    ("multi step 1.7", lambda t: ops.adam_step_multi([t(3)], [t(3)], [t(3)], [t(3)], steps=[1.7], lr=0.1), ValueError,
     r"'steps\[0\]' must be an int >= 1"),
    ("multi step 2**63", lambda t: ops.adam_step_multi([t(3)], [t(3)], [t(3)], [t(3)], steps=[2**63], lr=0.1), ValueError,
     r"'steps\[0\]' must be <="),
    ("multi steps length", lambda t: ops.adam_step_multi([t(3)], [t(3)], [t(3)], [t(3)], steps=[1, 2], lr=0.1), ValueError,
     "'params' has 1 entries but 'steps' has 2"),
    ("multi same param twice", lambda t: (lambda p: ops.adam_step_multi([p, p], [t(3), t(3)], [t(3), t(3)], [t(3), t(3)],
                                                                         steps=[1, 1], lr=0.1))(t(3)), ValueError,
     r"'params\[0\]' and 'params\[1\]' share memory"),
    ("multi param_outs None entry", lambda t: ops.adam_step_multi([t(3), t(3)], [t(3), t(3)], [t(3), t(3)], [t(3), t(3)],
                                                                 steps=[1, 1], lr=0.1, param_outs=[t(3, dtype=B16), None]),
     TypeError, r"'param_outs\[1\]' must be a torch.Tensor, got NoneType"),
    ("multi params a tensor", lambda t: ops.adam_step_multi(t(3), [t(3)], [t(3)], [t(3)], steps=[1], lr=0.1), TypeError,
     "'params' must be a sequence"),
    ("multi grad dtype", lambda t: ops.adam_step_multi([t(3), t(3)], [t(3), t(3, dtype=torch.int32)], [t(3), t(3)],
                                                        [t(3), t(3)], steps=[1, 1], lr=0.1), TypeError,
     r"'grads\[1\]' has dtype int32"),
]


def assert_same_refusal(name, call, exc, words, monkeypatch) -> None:
    """``call`` raises ``exc`` matching ``words`` with CPU tensors and, word for word, with stood-in
    CUDA tensors, where no CUDA kernel call happens."""
    with pytest.raises(exc, match=words) as on_cpu:
        call(_make("cpu"))
    rec = install_recorder(monkeypatch)
    with pytest.raises(exc, match=words) as on_cuda:
        call(_make("cuda"))
    assert rec.calls == [], f"{name}: the CUDA path reached the kernels with bad input"
    assert str(on_cuda.value) == str(on_cpu.value)


@pytest.mark.parametrize("name, call, exc, words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_same_error_on_cpu_and_cuda_paths(name, call, exc, words, monkeypatch):
    assert_same_refusal(name, call, exc, words, monkeypatch)


def test_mixed_devices_are_named(monkeypatch):
    install_recorder(monkeypatch)
    with pytest.raises(ValueError, match=r"'tensors\[0\]' is on cuda:0 but 'flat' is on cpu"):
        ops.pack([fake(2)], [0], torch.zeros(8))
    with pytest.raises(ValueError, match=r"'tensors\[0\]' is on cpu but 'flat' is on cuda:0"):
        ops.pack([torch.zeros(2)], [0], fake(8))
    with pytest.raises(ValueError, match="'grad' is on cpu but 'param' is on cuda:0"):
        ops.adam_step(fake(3), torch.zeros(3), fake(3), fake(3), lr=0.1, step=1)
    with pytest.raises(ValueError, match="'tensor' is on meta"):
        ops.sum_squares(torch.zeros(3, device="meta"))


def test_integer_like_offsets_and_steps_are_accepted():
    import numpy as np

    flat = torch.full((8,), 5.0)
    ops.pack([torch.ones(2)], [np.int64(3)], flat)
    assert flat.tolist() == [0, 0, 0, 1, 1, 0, 0, 0]
    p, g, m, v = torch.ones(3), torch.ones(3), torch.zeros(3), torch.zeros(3)
    ops.adam_step_multi([p], [g], [m], [v], steps=[torch.tensor(1)], lr=0.1)
    ops.adam_step(p, g, m, v, lr=0.1, step=np.int32(2))
    assert not torch.equal(p, torch.ones(3))


def test_cast_with_matching_dtype_and_dst_is_fine():
    x = torch.randn(7)
    dst = torch.empty(7, dtype=B16)
    assert ops.cast(x, dst, dtype=B16) is dst and torch.equal(dst, x.to(B16))
