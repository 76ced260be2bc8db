"""On a GPU: the multi-tensor step's CUDA side (issue 11). ops.adam_step_multi lets the CUDA
binding check a plain list in C++ (dtypes, sizes, devices, shared memory) before launching, and
ops.sum_squares_multi sums many tensors without a host sync. Bad input must raise the CPU path's
named errors and launch nothing; results must equal the per-tensor calls bit for bit.
Skipped where torch has no CUDA device or zerocore was built without its CUDA part."""
from __future__ import annotations

import pytest
import torch

from zerocore import ops
from zerocore.sharding.optimizer import AdamHyper, MultiShardStep

from test_cuda import DEV, _why_skip
from test_kernel_args import CASES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_why_skip() is not None, reason=str(_why_skip()))]
MULTI = [c for c in CASES if c[0].startswith("multi")]


@pytest.mark.parametrize("name, call, exc, words", MULTI, ids=[c[0] for c in MULTI])
def test_adam_multi_bad_input_same_error_on_a_real_gpu(name, call, exc, words):
    with pytest.raises(exc, match=words) as on_cpu:
        call(lambda *shape, dtype=torch.float32: torch.zeros(*shape, dtype=dtype))
    with pytest.raises(exc, match=words) as on_gpu:
        call(lambda *shape, dtype=torch.float32: torch.zeros(*shape, dtype=dtype, device=DEV))
    assert str(on_gpu.value) == str(on_cpu.value)


def test_adam_multi_overlap_far_down_the_list_launches_nothing():
    g = torch.Generator(device=DEV).manual_seed(0)
    p, gr, m, v = ([torch.randn(33, device=DEV, generator=g) for _ in range(200)] for _ in range(4))
    gr[199] = p[3]
    before = [t.clone() for t in p + m + v]
    with pytest.raises(ValueError, match=r"'params\[3\]' and 'grads\[199\]' share memory"):
        ops.adam_step_multi(p, gr, m, v, steps=[2] * 200, lr=1e-3)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(before, p + m + v))


def test_sum_squares_multi_equals_the_per_tensor_sums():
    g = torch.Generator(device=DEV).manual_seed(1)
    ts = [torch.randn(n, device=DEV, generator=g).to(dt) for n, dt in
          [(1, torch.float32), (17, torch.bfloat16), (0, torch.float32), (100_003, torch.float16), (4096, torch.float32)]]
    want = torch.stack([torch.stack([s.double(), b.double()]) for s, b in
                        (ops.sum_squares(t, sync=False) for t in ts)]).sum(0)
    got = ops.sum_squares_multi(ts, sync=False)
    assert isinstance(got, torch.Tensor) and got.is_cuda and torch.equal(got, want)
    total, bad = ops.sum_squares_multi(ts)
    assert total == want[0].item() and bad is False
    ts[3][5] = float("nan")
    assert ops.sum_squares_multi(ts)[1] is True


class _Shard:
    def __init__(self, n, tile, out, seed):
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.master = torch.randn(n, device=DEV, generator=g)
        self.exp_avg = torch.rand(n, device=DEV, generator=g)
        self.exp_avg_sq = torch.rand(n, device=DEV, generator=g)
        self.param_out = torch.empty(n, dtype=torch.bfloat16, device=DEV) if out else None
        self.tile = tile
        self.pieces = None  # one hyper-parameter group over the whole owned range (OptimizerShard's default)


def test_multi_shard_step_equals_per_tile_calls_on_gpu():
    spec = [(37, 10, True), (0, 5, True), (100_000, 100_000, True), (513, 64, True), (70_001, 16_384, True)]
    hp = AdamHyper(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05, decoupled=True)
    a = [_Shard(n, t, o, k) for k, (n, t, o) in enumerate(spec)]
    b = [_Shard(n, t, o, k) for k, (n, t, o) in enumerate(spec)]
    multi = MultiShardStep(a, list(range(len(a))))
    g = torch.Generator(device=DEV).manual_seed(2)
    for step in (1, 2):
        grads = [torch.randn(n, device=DEV, generator=g).to(torch.bfloat16) for n, _, _ in spec]
        multi.step(grads, hp, step=step, grad_scale=0.5)
        for s, gr in zip(b, grads):
            n = s.master.numel()
            for lo in range(0, n, s.tile):
                hi = min(n, lo + s.tile)
                ops.adam_step(s.master[lo:hi], gr[lo:hi], s.exp_avg[lo:hi], s.exp_avg_sq[lo:hi], lr=hp.lr,
                              betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay, step=step, grad_scale=0.5,
                              param_out=s.param_out[lo:hi])
    for x, y in zip(a, b):
        for name in ("master", "exp_avg", "exp_avg_sq", "param_out"):
            assert torch.equal(getattr(x, name), getattr(y, name)), name
