"""The CUDA kernels against their CPU oracles, on a GPU. Skipped (cleanly, with the reason)
where torch has no CUDA device or zerocore was built without its CUDA part.

Oracle: the CPU kernels (themselves tested against zerocore.ops.reference). The GPU Adam and
casts must equal them bit for bit: same host-folded scalars (zc::adam_scalars), same operation
order, explicitly rounded float operations (no FMA contraction), the same bf16/fp16 rounding
code. Exceptions, by design: NaN *payloads* (x86 and GPUs produce different default NaNs, so
NaN positions are compared, not bits) and the sum of squares (double accumulation in another
order: relative 1e-12). Every test draws fresh random data from a seeded generator.
"""
from __future__ import annotations

import os
import random
import zlib

import pytest
import torch

import zerocore
from zerocore import ops
from zerocore.ops import cuda as zcuda
from zerocore.ops.reference import adam_step_reference, pack_reference


def _why_skip() -> str | None:
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    if not zcuda.available():
        return "zerocore built without CUDA kernels: " + zcuda.unavailable_reason()
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_why_skip() is not None, reason=str(_why_skip()))]

DEV = torch.device("cuda", 0)
SIZES = [1, 3, 4, 5, 17, 1000, 4095, 4096, 4097, 16384, 16385, 3 * 4096 + 7, 1_000_003]  # around the 4096-element chunk
HP = dict(lr=3e-3, betas=(0.9, 0.995), eps=1e-8, weight_decay=0.05)


# Fresh data on every proof run (benchmarks/gpu_proof.py sets ZC_TEST_SEED at random and records
# it), reproducible by setting the same seed.
BASE_SEED = int(os.environ.get("ZC_TEST_SEED", "0"))


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()) ^ BASE_SEED)


def _adam_state(n, gen, grad_dtype):
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen).to(grad_dtype)
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01 + 1e-6
    return p, g, m, v


def _same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    a, b = a.cpu(), b.cpu()
    assert a.dtype == b.dtype and a.shape == b.shape, what
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    assert torch.equal(nan_a, nan_b), f"{what}: NaN positions differ"
    ia = a[~nan_a].view(torch.int16 if a.element_size() == 2 else torch.int32)
    ib = b[~nan_b].view(torch.int16 if b.element_size() == 2 else torch.int32)
    bad = (ia != ib).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.numel()} elements differ, first at {bad[0].item()}"


# ---- Adam ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("adamw", [True, False])
def test_adam_equals_cpu_kernel(n, grad_dtype, out_dtype, adamw):
    gen = _gen("adam", n, str(grad_dtype), str(out_dtype), adamw)
    p, g, m, v = _adam_state(n, gen, grad_dtype)
    step = int(torch.randint(1, 1000, (1,), generator=gen))
    hp = dict(HP, step=step, adamw_mode=adamw, grad_scale=0.37)
    gp, gg, gm, gv = (t.to(DEV) for t in (p, g, m, v))
    gout = None if out_dtype is None else torch.full((n,), float("nan"), dtype=out_dtype, device=DEV)
    cout = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
    ops.adam_step(gp, gg, gm, gv, param_out=gout, **hp)  # routed to the CUDA kernel
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    ops.adam_step(p, g, m, v, param_out=cout, **hp)  # CPU kernel
    for got, want, name in ((gp, p, "param"), (gm, m, "exp_avg"), (gv, v, "exp_avg_sq")):
        _same_bits(got, want, name)
    if out_dtype is not None:
        _same_bits(gout, cout, "param_out")
    adam_step_reference(rp, g, rm, rv, **hp)  # and near the plain-torch formula
    torch.testing.assert_close(gp.cpu(), rp, rtol=1e-6, atol=1e-7)


def test_adam_many_tensors_several_launches_views_and_steps():
    """300 tensors (launches split by step count and dtypes), odd sizes, empty ones, views at odd offsets
    (scalar path), different step counts (separate launches), mixed grad dtypes and output dtypes.
    ``param_outs`` is all or nothing per call (a None entry is refused), so the tensors with an output
    go in one call and those without in another."""
    rnd = random.Random(BASE_SEED + 1)
    gen = _gen("many")
    params, grads, ms, vs, outs, steps, cpu = [], [], [], [], [], [], []
    for i in range(300):
        n = rnd.choice([0, 1, 5, 127, 4096, 20000, 70001])
        gdt = rnd.choice([torch.float32, torch.bfloat16, torch.float16])
        odt = rnd.choice([torch.bfloat16, torch.float16]) if i % 2 else None
        p, g, m, v = _adam_state(n, gen, gdt)
        cpu.append((p.clone(), g.clone(), m.clone(), v.clone(), None if odt is None else torch.empty(n, dtype=odt)))
        shift = 1 if i % 3 == 0 else 0  # a view starting one element into its storage
        def place(t):
            buf = torch.empty(n + shift, dtype=t.dtype, device=DEV)
            buf[shift:].copy_(t)
            return buf[shift:]
        params.append(place(p)); grads.append(place(g)); ms.append(place(m)); vs.append(place(v))
        outs.append(None if odt is None else torch.empty(n, dtype=odt, device=DEV))
        steps.append(1 + i % 4)
    hp = dict(HP, adamw_mode=True, grad_scale=2.0)
    for part in (slice(0, None, 2), slice(1, None, 2)):  # without outputs, with them
        out_part = outs[part] if outs[part][0] is not None else None
        ops.adam_step_multi(params[part], grads[part], ms[part], vs[part], steps=steps[part], param_outs=out_part,
                            **hp)
    for i, (p, g, m, v, o) in enumerate(cpu):
        ops.adam_step(p, g, m, v, step=steps[i], param_out=o, **hp)
        _same_bits(params[i], p, f"param[{i}]")
        _same_bits(ms[i], m, f"exp_avg[{i}]")
        _same_bits(vs[i], v, f"exp_avg_sq[{i}]")
        if o is not None:
            _same_bits(outs[i], o, f"param_out[{i}]")


@pytest.mark.parametrize("count, grad_dtype, out_dtype", [(200, torch.float32, None), (700, torch.float32, None),
                                                        (600, torch.bfloat16, torch.float16)])
def test_adam_one_key_one_launch_and_past_the_table(count, grad_dtype, out_dtype):
    """The usual call: every tensor with the same step and dtypes. 200 fit one launch's table
    (512 with CUDA >= 12.1), 600 / 700 take two. Odd sizes around the 4096-element chunk, and
    every array at its own offset of 0-3 elements, so some tensors take the vector path and
    others (any array misaligned) the scalar one."""
    rnd = random.Random(BASE_SEED + count)
    gen = _gen("one key", count, str(grad_dtype))
    gpu, cpu = [], []
    for i in range(count):
        n = rnd.choice([1, 3, 4, 5, 7, 33, 4095, 4096, 4097, 12289, 50_001])
        p, g, m, v = _adam_state(n, gen, grad_dtype)
        cpu.append((p.clone(), g.clone(), m.clone(), v.clone(),
                    None if out_dtype is None else torch.empty(n, dtype=out_dtype)))

        def place(t, shift=None):
            shift = rnd.choice([0, 0, 0, 1, 2, 3]) if shift is None else shift
            buf = torch.empty(n + shift, dtype=t.dtype, device=DEV)
            buf[shift:].copy_(t)
            return buf[shift:]
        gpu.append((place(p), place(g), place(m), place(v),
                    None if out_dtype is None else place(torch.empty(n, dtype=out_dtype))))
    hp = dict(HP, adamw_mode=True, grad_scale=0.5)
    ops.adam_step_multi([t[0] for t in gpu], [t[1] for t in gpu], [t[2] for t in gpu], [t[3] for t in gpu],
                        steps=[7] * count, param_outs=None if out_dtype is None else [t[4] for t in gpu], **hp)
    for i, ((p, g, m, v, o), (gp, _, gm, gv, go)) in enumerate(zip(cpu, gpu)):
        ops.adam_step(p, g, m, v, step=7, param_out=o, **hp)
        _same_bits(gp, p, f"param[{i}]")
        _same_bits(gm, m, f"exp_avg[{i}]")
        _same_bits(gv, v, f"exp_avg_sq[{i}]")
        if o is not None:
            _same_bits(go, o, f"param_out[{i}]")


def test_adam_views_packed_at_16_bytes_on_the_line_aligned_grid():
    """Tensors packed into one buffer at 16-byte boundaries (every 4-float offset into a 128-byte line), the
    layout whose chunk grid the kernel moves onto lines (a first chunk shorter by the offset, vector accesses
    from every chunk): bit for bit the CPU kernel's, sizes around the chunk and the line."""
    rnd = random.Random(BASE_SEED + 16)
    gen = _gen("packed16")
    sizes = [rnd.choice([1, 4, 28, 29, 4064, 4068, 4092, 4096, 4100, 8191, 12289, 50_001]) for _ in range(160)]
    offs, off = [], 4  # the first tensor 16 bytes into the buffer's first line
    for n in sizes:
        offs.append(off)
        off += (n + 3) // 4 * 4
    cpu = [_adam_state(n, gen, torch.float32) for n in sizes]
    bufs = [torch.empty(off, device=DEV) for _ in range(4)]
    gpu = []
    for (p, g, m, v), o, n in zip(cpu, offs, sizes):
        views = [b[o:o + n] for b in bufs]
        for view, t in zip(views, (p, g, m, v)):
            view.copy_(t)
        gpu.append(views)
    assert {o % 32 for o in offs} >= {4, 8, 12, 16, 20, 24, 28}, "the layout must cover every 16-byte offset in a line"
    hp = dict(HP, adamw_mode=True, grad_scale=0.5)
    ops.adam_step_multi(*[[t[k] for t in gpu] for k in range(4)], steps=[3] * len(sizes), **hp)
    for i, ((p, g, m, v), (gp, _, gm, gv)) in enumerate(zip(cpu, gpu)):
        ops.adam_step(p, g, m, v, step=3, **hp)
        _same_bits(gp, p, f"param[{i}]")
        _same_bits(gm, m, f"exp_avg[{i}]")
        _same_bits(gv, v, f"exp_avg_sq[{i}]")


def test_adam_device_grad_scale_and_nonfinite_grads():
    gen = _gen("scale")
    n = 50_001
    p, g, m, v = _adam_state(n, gen, torch.float16)
    g[::997] = float("inf")
    g[5] = float("nan")
    gp, gg, gm, gv = (t.to(DEV) for t in (p, g, m, v))
    scale = torch.tensor([0.25], device=DEV)  # read by the kernel: no host sync
    zcuda.adam_step_multi([gp], [gg], [gm], [gv], steps=[3], grad_scale=scale, **HP)
    ops.adam_step(p, g, m, v, step=3, grad_scale=0.25, **HP)
    for got, want, name in ((gp, p, "param"), (gm, m, "exp_avg"), (gv, v, "exp_avg_sq")):
        _same_bits(got, want, name)
    assert torch.isnan(gp.cpu()[::997]).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_adam_nonfinite_device_grad_scale_skips_the_update(bad):
    """The engine's deferred Inf/NaN decision (runtime/deferred_skip.py): a non-finite coefficient in
    device memory makes the kernel write nothing (parameters, moments, 16-bit copies), as the CPU skips."""
    gen = _gen("skip")
    p, g, m, v = _adam_state(10_007, gen, torch.bfloat16)
    gp, gg, gm, gv = (t.to(DEV) for t in (p, g, m, v))
    out = torch.full((10_007,), 7.0, dtype=torch.bfloat16, device=DEV)
    zcuda.adam_step_multi([gp], [gg], [gm], [gv], steps=[3], grad_scale=torch.tensor([bad], device=DEV),
                          param_outs=[out], **HP)
    for got, want, name in ((gp, p, "param"), (gm, m, "exp_avg"), (gv, v, "exp_avg_sq")):
        _same_bits(got, want, name)
    assert torch.equal(out.cpu(), torch.full((10_007,), 7.0, dtype=torch.bfloat16))


def test_fused_adam_on_cuda_matches_torch_adamw_and_cpu():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(37, 53), torch.nn.GELU(), torch.nn.Linear(53, 11))
    ref = [p.detach().clone().to(DEV).requires_grad_() for p in model.parameters()]
    cpu = [p.detach().clone().requires_grad_() for p in model.parameters()]
    gpu = [p.detach().clone().to(DEV).requires_grad_() for p in model.parameters()]
    opts = [zerocore.FusedAdam(gpu, lr=1e-2, weight_decay=0.1), torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1,
            foreach=False), zerocore.FusedAdam(cpu, lr=1e-2, weight_decay=0.1)]
    gen = _gen("fused")
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=gen) for p in cpu]
        for params in (gpu, ref, cpu):
            for p, g in zip(params, grads):
                p.grad = g.to(p.device)
        for opt in opts:
            opt.step()
    for a, b, c in zip(gpu, ref, cpu):  # torch's GPU ops may contract into FMAs: a few ulps after 5 steps
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
        _same_bits(a.detach(), c.detach(), "FusedAdam cuda vs cpu")
    assert opts[0].state[gpu[0]]["exp_avg"].is_cuda


# ---- pack / unpack ------------------------------------------------------------------------------
@pytest.mark.parametrize("count", [40, 300, 900])  # the piece table: small inline, large inline, in device memory
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int64])
def test_pack_unpack_equal_cpu(dtype, count):
    rnd = random.Random(f"{dtype}{count}{BASE_SEED}")
    sizes = [rnd.choice([1, 2, 3, 7, 64, 1000, 4097, 70000]) for _ in range(count)]
    offsets, cursor = [], rnd.randint(0, 9)
    for n in sizes:
        offsets.append(cursor)
        cursor += n + rnd.choice([0, 0, 1, 5, 33])  # gaps, some none
    total = cursor + 17
    order = list(range(len(sizes)))
    rnd.shuffle(order)  # tensors need not come in offset order
    sizes = [sizes[i] for i in order]
    offsets = [offsets[i] for i in order]
    gen = _gen("pack", str(dtype), count)
    cpu = [(torch.randn(n, generator=gen) * 100).to(dtype) for n in sizes]
    gpu = [t.to(DEV) for t in cpu]
    flat = torch.full((total,), 7, dtype=dtype, device=DEV)  # poisoned: gaps must become 0
    ops.pack(gpu, offsets, flat)
    want = torch.full((total,), 7, dtype=dtype)
    ops.pack(cpu, offsets, want)
    ref = torch.empty(total, dtype=dtype)
    pack_reference(cpu, offsets, ref)
    assert torch.equal(flat.cpu(), want) and torch.equal(want, ref)
    back = [torch.zeros_like(t) for t in gpu]
    ops.unpack(flat, back, offsets)
    for a, b in zip(back, cpu):
        assert torch.equal(a.cpu(), b)


def test_pack_grads_in_one_launch_equals_the_checked_pack_and_refuses_like_the_cpu_one():
    """The reducer's hot path on a GPU (ops.params.pack_grads_on): present gradients at their offsets,
    gaps and absent ones zeroed, every .grad dropped; a gradient that does not fit: False, nothing touched."""
    from zerocore.ops.params import pack_grads_on

    pack_grads = pack_grads_on(torch.device(DEV))
    gen = _gen("pack_grads")
    params = [torch.nn.Parameter(torch.zeros(n, device=DEV, dtype=torch.bfloat16)) for n in (3, 100, 1, 4097, 2)]
    grads = [torch.randn(p.numel(), generator=gen).bfloat16() for p in params]
    for p, g in zip(params, grads):
        p.grad = g.to(DEV)
    params[2].grad = None  # no gradient this step: its slot is zeroed
    offsets = [0, 5, 200, 300, 4400]
    flat = torch.full((5000,), 7.0, device=DEV, dtype=torch.bfloat16)
    assert pack_grads(params, offsets, flat) is True
    want = torch.zeros(5000, dtype=torch.bfloat16)
    for i, (g, o) in enumerate(zip(grads, offsets)):
        if i != 2:
            want[o:o + g.numel()] = g
    assert torch.equal(flat.cpu(), want) and all(p.grad is None for p in params)
    for p in (params[0], params[1], params[4]):
        p.grad = torch.ones(p.numel(), device=DEV, dtype=torch.bfloat16)
    flat.fill_(7.0)
    assert pack_grads(params, [0, 5, 200, 300, 4999], flat) is False  # the last one would end past the bucket
    assert all(params[i].grad is not None for i in (0, 1, 4)) and bool((flat == 7).all())


def test_pack_misaligned_views_and_errors():
    base = torch.arange(1000, dtype=torch.float16, device=DEV)
    views = [base[1:8], base[3:700], base[701:702]]  # 2-byte aligned sources
    flat = torch.full((1000,), -1.0, dtype=torch.float16, device=DEV)
    ops.pack(views, [5, 13, 999], flat)
    want = torch.full((1000,), -1.0, dtype=torch.float16)
    ops.pack([v.cpu() for v in views], [5, 13, 999], want)
    assert torch.equal(flat.cpu(), want)
    with pytest.raises(ValueError, match="overlap"):
        ops.pack(views, [5, 10, 999], flat)
    with pytest.raises(ValueError, match="does not fit"):
        ops.pack(views, [5, 13, 1000], flat)
    with pytest.raises(TypeError, match="dtype"):
        ops.pack([base.float()], [0], flat)


# ---- casts --------------------------------------------------------------------------------------
def _nasty(n, gen):
    x = torch.randint(-2**31, 2**31 - 1, (n,), generator=gen, dtype=torch.int64).to(torch.int32).view(torch.float32)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 65504.0, 65519.0, 65520.0,
                             6.1035156e-05, 5.9604645e-08, 2.9802322e-08, 3.3895314e38, 1e-40, 1.0 + 2**-8])
    x[: min(n, specials.numel())] = specials[: min(n, specials.numel())]
    return x


@pytest.mark.parametrize("n", [1, 5, 16, 1_000_003])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_equals_cpu_both_ways(n, dtype):
    x = _nasty(n, _gen("cast", n, str(dtype)))
    got = ops.cast(x.to(DEV), dtype=dtype)
    want = ops.cast(x, dtype=dtype)
    _same_bits(got, want, "fp32 -> 16")
    back = ops.cast(got, dtype=torch.float32)
    _same_bits(back, ops.cast(want, dtype=torch.float32), "16 -> fp32")
    other = torch.bfloat16 if dtype == torch.float16 else torch.float16
    _same_bits(ops.cast(got, dtype=other), ops.cast(want, dtype=other), "16 -> 16")
    # from an odd element offset: the scalar path
    src = torch.empty(n + 1, dtype=torch.float32, device=DEV)
    src[1:].copy_(x)
    _same_bits(ops.cast(src[1:], dtype=dtype), want, "misaligned fp32 -> 16")


_CAST_PAIRS = [(torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.bfloat16, torch.float32),
               (torch.float16, torch.float32), (torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)]


@pytest.mark.parametrize("src_dtype, dst_dtype", _CAST_PAIRS, ids=[f"{a}-{b}" for a, b in _CAST_PAIRS])
def test_cast_odd_sizes_and_offsets(src_dtype, dst_dtype):
    """Sizes that are not a multiple of 8 and views at element offsets of source and destination:
    equal offsets (modulo the vector) take the vector path (4-wide beside fp32, 8-wide between 16-bit types)
    after a scalar head, others a narrower
    or scalar one. Nothing outside the destination view is written."""
    gen = _gen("cast offsets", str(src_dtype), str(dst_dtype))
    for n in [1, 7, 8, 9, 15, 17, 31, 4099, 100_003]:
        x = _nasty(n, gen)
        x = x if src_dtype == torch.float32 else ops.cast(x, dtype=src_dtype)
        want = ops.cast(x, dtype=dst_dtype)
        for so, do in [(0, 0), (1, 1), (3, 3), (5, 5), (1, 0), (0, 3), (4, 0), (2, 6), (4, 4)]:
            src = torch.empty(n + so, dtype=src_dtype, device=DEV)
            src[so:].copy_(x)
            out = torch.full((n + do + 9,), 3.0, dtype=dst_dtype, device=DEV)  # 9 guard elements after
            ops.cast(src[so:], out[do:do + n])
            _same_bits(out[do:do + n], want, f"n={n} offsets {so}/{do}")
            rest = torch.cat([out[:do], out[do + n:]]).cpu()
            assert torch.equal(rest, torch.full_like(rest, 3.0)), f"n={n} offsets {so}/{do}: wrote outside"
    # through UVA at an offset: pinned source, device destination and back
    x = _nasty(10_007, gen)
    x = x if src_dtype == torch.float32 else ops.cast(x, dtype=src_dtype)
    pinned = torch.empty(10_010, dtype=src_dtype).pin_memory()
    pinned[3:].copy_(x)
    dev = torch.empty(10_010, dtype=dst_dtype, device=DEV)
    ops.cast(pinned[3:], dev[3:])
    _same_bits(dev[3:], ops.cast(x, dtype=dst_dtype), "pinned -> device at offset 3")
    host = torch.empty(10_010, dtype=src_dtype).pin_memory()
    ops.cast(dev[3:], host[3:])
    torch.cuda.synchronize()
    _same_bits(host[3:], ops.cast(ops.cast(x, dtype=dst_dtype), dtype=src_dtype), "device -> pinned at offset 3")


def test_cast_fused_with_host_copy_and_pageable_refused():
    x = _nasty(100_003, _gen("hostcast"))
    pinned = torch.empty(x.numel(), dtype=torch.bfloat16).pin_memory()
    ops.cast(x.to(DEV), pinned)  # the kernel writes host memory
    torch.cuda.synchronize()
    _same_bits(pinned, ops.cast(x, dtype=torch.bfloat16), "device fp32 -> pinned bf16")
    dev = torch.empty(x.numel(), dtype=torch.float32, device=DEV)
    ops.cast(pinned, dev)  # the kernel reads host memory
    _same_bits(dev, ops.cast(pinned.clone(), dtype=torch.float32), "pinned bf16 -> device fp32")
    with pytest.raises(ValueError, match="pageable"):
        ops.cast(x.to(DEV), torch.empty(x.numel(), dtype=torch.bfloat16))


# ---- sum of squares -----------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 7, 4096, 16385, 5_000_003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sum_squares_equals_cpu(n, dtype):
    x = torch.randn(n, generator=_gen("ss", n, str(dtype))).to(dtype)
    got, bad = ops.sum_squares(x.to(DEV))
    want, wbad = ops.sum_squares(x)
    assert got == pytest.approx(want, rel=1e-12, abs=0) and bad is wbad is False


def test_sum_squares_no_sync_flag_and_determinism():
    x = torch.randn(3_000_001, generator=_gen("ss2")).to(DEV)
    s1, f1 = ops.sum_squares(x, sync=False)
    assert s1.is_cuda and f1.is_cuda and s1.dtype == torch.float64 and f1.dtype == torch.bool and s1.dim() == 0
    s2, _ = ops.sum_squares(x, sync=False)
    assert torch.equal(s1, s2) and not f1.item()  # same blocks, same order: same bits
    for bad in (float("inf"), float("-inf"), float("nan")):
        y = x.clone()
        y[2_999_999] = bad
        assert ops.sum_squares(y)[1] is True
    big = torch.full((1000,), 3e38, device=DEV)  # squares overflow fp32, not double
    total, flag = ops.sum_squares(big)
    assert flag is False and total == pytest.approx(1000 * big[0].item() ** 2, rel=1e-12)


# ---- pinned pool and async copies ---------------------------------------------------------------
def test_pinned_pool_and_async_copier_roundtrip():
    pool = zcuda.PinnedBufferPool(limit_bytes=256 << 20)
    copier = zcuda.AsyncCopier(DEV, pool=pool)
    src = torch.randn(3_000_007, device=DEV)
    host = pool.empty(src.shape, torch.float32)
    assert host.is_pinned() and host.data_ptr() % 4096 == 0
    ev = copier.copy(host, src)  # D2H on the side stream, after the randn on the current stream
    ev.synchronize()
    assert torch.equal(host, src.cpu())
    back = torch.empty_like(src)
    copier.wait(copier.copy(back, host))
    assert torch.equal(back, src)
    half = pool.empty(src.shape, torch.bfloat16)
    copier.cast(half, src).synchronize()  # cast fused with the D2H copy
    assert torch.equal(half, ops.cast(src.cpu(), dtype=torch.bfloat16))
    ptr = host.data_ptr()
    del host  # released while nothing is in flight: the next request of that size reuses it
    torch.cuda.synchronize()
    again = pool.empty((3_000_007,), torch.float32)
    assert again.data_ptr() == ptr and pool.stats()["hits"] >= 1
    with pytest.raises(RuntimeError, match="limit"):
        pool.empty((300 << 20,), torch.uint8)
    with pytest.raises(ValueError, match="pinned"):
        zcuda.copy_async(torch.empty(10), torch.zeros(10, device=DEV))
    del again, half
    assert pool.trim() > 0


def test_pinned_block_not_reused_while_copy_in_flight():
    pool = zcuda.PinnedBufferPool()
    side = torch.cuda.Stream(DEV)
    big = torch.randn(64 << 20, device=DEV)  # 256 MiB: the copy takes a while
    host = pool.empty(big.shape, torch.float32)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # keep the side stream busy so the copy is surely pending
    side.wait_stream(torch.cuda.current_stream(DEV))
    zcuda.copy_async(host, big, stream=side, pool=pool)
    ptr = host.data_ptr()
    del host  # released with the copy still queued
    other = pool.empty((64 << 20,), torch.float32)
    assert other.data_ptr() != ptr, "a block with a pending copy was handed out again"
    side.synchronize()


# ---- tensors over 2^31 elements -----------------------------------------------------------------
def _need(nbytes: int) -> None:
    free, _ = torch.cuda.mem_get_info(DEV)
    if free < nbytes * 1.1:
        pytest.skip(f"needs {nbytes / 2**30:.1f} GiB of free GPU memory, {free / 2**30:.1f} GiB free")


BIG = 2**31 + 4099  # past int32 indexing, not a multiple of the chunk or of 4


@pytest.mark.slow
def test_adam_over_2pow31_elements():
    _need(BIG * (4 * 3 + 2 + 2 + 4))  # + a transient fp32 while making the bf16 grads
    gen = torch.Generator(device=DEV).manual_seed(5)
    p = torch.randn(BIG, device=DEV, generator=gen)
    g = torch.randn(BIG, device=DEV, generator=gen).to(torch.bfloat16)
    m = torch.randn(BIG, device=DEV, generator=gen) * 0.1
    v = torch.rand(BIG, device=DEV, generator=gen) * 0.01 + 1e-6
    out = torch.empty(BIG, dtype=torch.float16, device=DEV)
    windows = [(0, 1 << 20), (2**31 - (1 << 20), BIG)]  # the start, and across 2^31 to the end
    before = [tuple(t[a:b].cpu() for t in (p, g, m, v)) for a, b in windows]
    ops.adam_step(p, g, m, v, step=9, param_out=out, **HP)
    for (a, b), (cp, cg, cm, cv) in zip(windows, before):
        co = torch.empty(b - a, dtype=torch.float16)
        ops.adam_step(cp, cg, cm, cv, step=9, param_out=co, **HP)
        _same_bits(p[a:b], cp, f"param[{a}:{b}]")
        _same_bits(v[a:b], cv, f"exp_avg_sq[{a}:{b}]")
        _same_bits(out[a:b], co, f"param_out[{a}:{b}]")


@pytest.mark.slow
def test_cast_sum_squares_pack_over_2pow31_elements():
    _need(BIG * (2 + 4 + 2))
    x = torch.ones(BIG, dtype=torch.bfloat16, device=DEV)
    x[-3:] = 2.0
    total, bad = ops.sum_squares(x)
    assert total == BIG - 3 + 12 and bad is False  # exact in double
    y = ops.cast(x, dtype=torch.float32)
    assert y[-4:].tolist() == [1.0, 2.0, 2.0, 2.0] and y[:5].tolist() == [1.0] * 5
    del y
    flat = torch.full((BIG,), 5.0, dtype=torch.bfloat16, device=DEV)
    tail = torch.arange(10, dtype=torch.bfloat16, device=DEV)
    ops.pack([x[:100], tail], [0, BIG - 10], flat)  # a tensor past byte 2^32, gap zeroed
    assert flat[BIG - 10:].tolist() == tail.tolist() and flat[100:200].abs().sum().item() == 0
    assert flat[2**31 + 5].item() == 0
    back = torch.empty_like(tail)
    ops.unpack(flat, [back], [BIG - 10])
    assert torch.equal(back, tail)


# ---- the build ----------------------------------------------------------------------------------
def test_build_reports_archs_and_kernel_image():
    info = zcuda.build_info()
    assert info["built"] and info["devices"] >= 1
    major, minor = torch.cuda.get_device_capability(DEV)
    assert "cuda:0" in info["kernel_image"] and "no usable" not in info["kernel_image"]["cuda:0"]
    assert any(int(a[3:]) <= major * 10 + minor for a in info["archs"])
