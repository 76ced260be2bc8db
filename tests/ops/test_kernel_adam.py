"""adam_step against its plain-torch reference (zerocore.ops.reference) on every ISA path,
odd sizes, every gradient dtype and 16-bit output.

Tolerances: fp32 state rtol 1e-6 with atol 1e-7 for p and m (one fp32 ulp at |x|~1; torch's
own vectorised lerp/addcmul contract into FMAs, ours deliberately do not, so the last bit can
differ) and atol 1e-9 for v (its values are ~1e-2). The 16-bit output must equal the
round-to-nearest-even cast of the kernel's own fp32 result exactly, in every element.
"""
import pytest
import torch

from zerocore import ops
from zerocore.ops.reference import adam_step_reference

from conftest import SIZES


def _state(n, gen, grad_dtype):
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen).to(grad_dtype)
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01 + 1e-6
    return p, g, m, v


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("adamw", [True, False])
def test_adam_matches_reference(forced_isa, n, grad_dtype, out_dtype, adamw):
    gen = torch.Generator().manual_seed(hash((n, str(grad_dtype), str(out_dtype), adamw)) & 0xFFFF)
    p, g, m, v = _state(n, gen, grad_dtype)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    out = None if out_dtype is None else torch.full((n,), float("nan"), dtype=out_dtype)  # poisoned
    step = int(torch.randint(1, 1000, (1,), generator=gen))
    hp = dict(lr=3e-3, betas=(0.9, 0.995), eps=1e-8, weight_decay=0.05, step=step, adamw_mode=adamw,
              grad_scale=0.37)
    ops.adam_step(p, g, m, v, param_out=out, **hp)
    adam_step_reference(rp, g, rm, rv, **hp)
    torch.testing.assert_close(p, rp, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, rm, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(v, rv, rtol=1e-6, atol=1e-9)
    if out is not None:
        assert torch.equal(out, p.to(out_dtype)), "param_out must be the RNE cast of the updated fp32 param"


def test_isa_paths_are_bit_identical():
    """Same inputs, every ISA: identical bits (no FMA contraction anywhere, same op order)."""
    gen = torch.Generator().manual_seed(7)
    n = 100_003
    base = _state(n, gen, torch.bfloat16)
    results = []
    for isa in ops.supported_isas():
        p, g, m, v = (t.clone() for t in base)
        out = torch.empty(n, dtype=torch.float16)
        with ops.force_isa(isa):
            ops.adam_step(p, g, m, v, lr=1e-3, step=5, weight_decay=0.1, grad_scale=2.0, param_out=out)
        results.append((isa, p, m, v, out))
    for isa, *ts in results[1:]:
        for a, b in zip(ts, results[0][1:]):
            assert torch.equal(a.view(torch.int16) if a.dtype == torch.float16 else a.view(torch.int32),
                               b.view(torch.int16) if b.dtype == torch.float16 else b.view(torch.int32)), isa


def test_grad_scale_is_applied_as_read():
    """Scaling the gradient by s and passing grad_scale=1/s is the same update."""
    gen = torch.Generator().manual_seed(3)
    p, g, m, v = _state(4099, gen, torch.float32)
    p2, m2, v2 = p.clone(), m.clone(), v.clone()
    ops.adam_step(p, g * 1024.0, m, v, lr=1e-3, step=1, grad_scale=1 / 1024.0)
    ops.adam_step(p2, g, m2, v2, lr=1e-3, step=1)
    torch.testing.assert_close(p, p2, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_grad_scale_tensor_skips_and_a_nonfinite_number_is_refused(bad):
    """A one-element coefficient tensor (the engine's clip coefficient, on the tensors' device) that is
    not finite skips the update: nothing written, as the CUDA kernel skips (runtime/deferred_skip.py).
    The same value as a number is a caller's mistake: refused, naming it."""
    gen = torch.Generator().manual_seed(4)
    p, g, m, v = _state(1001, gen, torch.bfloat16)
    out = torch.full((1001,), 7.0, dtype=torch.bfloat16)
    kept = [t.clone() for t in (p, m, v, out)]
    ops.adam_step_multi([p], [g], [m], [v], steps=[2], lr=1e-3, grad_scale=torch.tensor([bad]), param_outs=[out])
    assert all(torch.equal(a, b) for a, b in zip((p, m, v, out), kept))
    with pytest.raises(ValueError, match="grad_scale"):
        ops.adam_step_multi([p], [g], [m], [v], steps=[2], lr=1e-3, grad_scale=bad)


def _args():
    return [torch.randn(10), torch.randn(10), torch.zeros(10), torch.zeros(10)]


@pytest.mark.parametrize("bad, exc, words", [
    (dict(lr=float("nan")), ValueError, "lr"),
    (dict(lr=-1.0), ValueError, "lr"),
    (dict(betas=(1.0, 0.999)), ValueError, "betas[0]"),
    (dict(betas=(0.9, float("nan"))), ValueError, "betas[1]"),
    (dict(eps=-1e-8), ValueError, "eps"),
    (dict(eps=float("inf")), ValueError, "eps"),
    (dict(weight_decay=float("nan")), ValueError, "weight_decay"),
    (dict(step=0), ValueError, "step"),
    (dict(grad_scale=float("inf")), ValueError, "grad_scale"),
    (dict(lr="0.1"), TypeError, "lr"),
])
def test_bad_hyperparameters_name_the_argument(bad, exc, words):
    kw = dict(lr=1e-3, step=1)
    kw.update(bad)
    with pytest.raises(exc, match=words.replace("[", r"\[").replace("]", r"\]")):
        ops.adam_step(*_args(), **kw)


@pytest.mark.parametrize("which, tensor, exc, words", [
    (1, torch.randn(9), ValueError, "'grad' has 9 elements"),
    (2, torch.zeros(11), ValueError, "'exp_avg' has 11"),
    (0, torch.randn(10, dtype=torch.float64), TypeError, "'param' has dtype float64"),
    (1, torch.randint(0, 3, (10,)), TypeError, "'grad' has dtype int64"),
    (3, torch.zeros(10, dtype=torch.bfloat16), TypeError, "'exp_avg_sq' has dtype bfloat16"),
    (0, torch.randn(10, 2)[:, 0], ValueError, "'param' must be contiguous"),
    (1, torch.randn(10, device="meta"), ValueError, "'grad' is on meta"),
])
def test_bad_tensors_name_the_argument(which, tensor, exc, words):
    args = _args()
    args[which] = tensor
    with pytest.raises(exc, match=words):
        ops.adam_step(*args, lr=1e-3, step=1)


def test_bad_param_out():
    args = _args()
    with pytest.raises(TypeError, match="'param_out' has dtype float32"):
        ops.adam_step(*args, lr=1e-3, step=1, param_out=torch.empty(10))
    with pytest.raises(ValueError, match="'param_out' has 3 elements"):
        ops.adam_step(*args, lr=1e-3, step=1, param_out=torch.empty(3, dtype=torch.bfloat16))


def test_native_binding_checks_too():
    """The binding re-checks what the Python layer checks: a direct call cannot crash."""
    from zerocore.ops import _loader

    lib = _loader.load()
    p, g, m, v = _args()
    with pytest.raises(ValueError, match="'grad' has 3 elements"):
        lib.adam_step(p, g[:3], m, v, None, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1, True, 1.0)
    with pytest.raises(TypeError, match="'exp_avg' must be float32"):
        lib.adam_step(p, g, m.double(), v, None, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1, True, 1.0)
    with pytest.raises(ValueError, match="lr"):
        lib.adam_step(p, g, m, v, None, float("nan"), 0.9, 0.999, 1e-8, 0.0, 1, True, 1.0)


def test_multi_equals_single_calls():
    """Many tensors in one call (each with its own step count and 16-bit output) give exactly
    what one call per tensor gives."""
    gen = torch.Generator().manual_seed(11)
    sizes = [1, 17, 65536 + 5, 1000, 3]
    states = [_state(n, gen, torch.float16) for n in sizes]
    copies = [tuple(t.clone() for t in s) for s in states]
    outs = [torch.full((n,), float("nan"), dtype=torch.bfloat16) for n in sizes]
    outs2 = [o.clone() for o in outs]
    steps = [1, 5, 9, 2, 100]
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, adamw_mode=True, grad_scale=0.5)
    ops.adam_step_multi([s[0] for s in states], [s[1] for s in states], [s[2] for s in states],
                        [s[3] for s in states], steps=steps, param_outs=outs, **hp)
    for (p, g, m, v), o, st in zip(copies, outs2, steps):
        ops.adam_step(p, g, m, v, step=st, param_out=o, **hp)
    for a, b in zip(states, copies):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    for a, b in zip(outs, outs2):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"'grads\[1\]' has 16 elements"):
        ops.adam_step_multi([torch.zeros(3), torch.zeros(17)], [torch.zeros(3), torch.zeros(16)],
                            [torch.zeros(3), torch.zeros(17)], [torch.zeros(3), torch.zeros(17)], steps=[1, 1], lr=0.1)
