"""``data_types.grad_accum_dtype: "fp32"`` with bf16 training at ZeRO stage 1 (DeepSpeed's BF16 optimizer): each
backward's bf16 gradients are added into a full fp32 buffer, reduced in fp32, stepped from fp32. Against a reference
built by hand on one rank (a bf16 copy of the model, each micro-batch's bf16 gradient of loss / gas summed in fp32,
torch's AdamW on an fp32 master with clipping): the accumulated gradient bit for bit before the step, the master
after two windows, every step's global norm. The same run with bf16 accumulation (no key) differs from that
reference: the test can tell the two apart. Also: ``.grad`` is None between backward and step (as DeepSpeed's BF16
optimizer leaves it), a failed backward leaves the window's earlier micro-batches as they were, ``no_sync()`` and
``loss.backward()`` accumulate the same way, and optimizer offload keeps bf16 accumulation (DeepSpeed's ZeRO
optimizer then)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerocore
from failing_backward import Boom
from zerocore.deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad
from zerocore.runtime.memory import held_bytes

GAS, D, LR, WD, CLIP = 8, 16, 1e-2, 0.01, 0.05


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 48), nn.Tanh(), nn.Linear(48, D))


def _cfg(accum="fp32", **zero) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
           "bf16": {"enabled": True}, "zero_optimization": {"stage": 1, **zero},
           "data_types": {"master_init": "rounded"},
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}}
    if accum:
        cfg["data_types"]["grad_accum_dtype"] = accum
    return cfg


def _batch(i: int):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(4, D, generator=g).bfloat16(), torch.randn(4, D, generator=g).bfloat16()


def _loss(model, i):
    x, y = _batch(i)
    return nn.functional.mse_loss(model(x).float(), y.float())


def _reference(windows: int):
    """Per window: the fp32 sum of each micro-batch's bf16 gradient of loss / gas (in order), the global norm,
    and the fp32 master after AdamW with clipping (the bf16 model re-rounded from it)."""
    model = _net().bfloat16()
    master = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    opt = torch.optim.AdamW(master, lr=LR, weight_decay=WD)
    sums, norms = [], []
    for w in range(windows):
        acc = [torch.zeros_like(m) for m in master]
        for j in range(GAS):
            model.zero_grad(set_to_none=True)
            (_loss(model, w * GAS + j) / GAS).backward()
            for a, p in zip(acc, model.parameters()):
                a.add_(p.grad)
        sums.append([a.clone() for a in acc])
        for m, a in zip(master, acc):
            m.grad = a
        norms.append(float(torch.nn.utils.clip_grad_norm_(master, CLIP)))
        opt.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), master):
                p.copy_(m)
    return sums, norms, [m.detach() for m in master]


def _train(engine, windows: int, *, torch_style=False, check=None) -> list[float]:
    """Trains ``windows`` windows; each boundary's global gradient norm."""
    norms = []
    for w in range(windows):
        for j in range(GAS):
            loss = _loss(engine, w * GAS + j)
            loss.backward() if torch_style else engine.backward(loss)
            if check is not None and j == GAS - 1:
                check(w)
            engine.step()
        norms.append(engine.global_grad_norm)
    return norms


def _accumulated(engine):
    return [safe_get_full_grad(p) for p in engine.module.parameters()]


@pytest.mark.parametrize("torch_style", [False, True])
def test_fp32_accumulation_is_the_bf16_optimizers(torch_style):
    sums, norms, master = _reference(2)
    engine = zerocore.initialize(_net(), _cfg())
    assert engine.groups[0].grad_full.dtype == torch.float32
    # what the buffer costs, counted as the memory report counts it: 4 bytes a (padded) parameter, not 2
    assert held_bytes(engine)["grads"] == 4 * sum(g.layout.padded for g in engine.groups)

    def check(w):
        for p in engine.module.parameters():
            assert p.grad is None  # the bf16 .grad was added into the fp32 buffer and dropped
        for got, want in zip(_accumulated(engine), sums[w]):
            assert torch.equal(got, want), f"window {w}: the accumulated gradient is not the fp32 sum"

    def step_norms(w):
        check(w)

    assert _train(engine, 2, torch_style=torch_style, check=step_norms) == pytest.approx(norms, rel=1e-6)
    for p, m in zip(engine.module.parameters(), master):
        torch.testing.assert_close(safe_get_full_fp32_param(p), m, rtol=1e-6, atol=1e-7)
    engine.destroy()


def test_bf16_accumulation_differs_from_that_reference():
    sums, _, _ = _reference(1)
    engine = zerocore.initialize(_net(), _cfg(accum=None))
    assert engine.groups[0].grad_full.dtype == torch.bfloat16
    seen = []
    _train(engine, 1, check=lambda w: seen.append(_accumulated(engine)))
    differs = [not torch.equal(g, w) for g, w in zip(seen[0], sums[0])]
    assert any(differs), "bf16 accumulation matched the fp32 sum: the test above could not tell them apart"
    engine.destroy()


def test_a_failed_backward_keeps_the_earlier_micro_batches():
    engine = zerocore.initialize(_net(), _cfg())
    ref = zerocore.initialize(_net(), _cfg())
    for e in (engine, ref):
        e.backward(_loss(e, 0))
        e.step()
    bad = engine(_batch(1)[0]).float()
    with pytest.raises(RuntimeError, match="boom"):
        engine.backward(Boom.apply(bad).sum() + bad.sum())  # some gradients arrive, then the backward raises
    for j in range(1, GAS):
        for e in (engine, ref):
            e.backward(_loss(e, j))
        if j == GAS - 1:
            for a, b in zip(_accumulated(engine), _accumulated(ref)):
                assert torch.equal(a, b)
        for e in (engine, ref):
            e.step()
    for a, b in zip(engine.module.parameters(), ref.module.parameters()):
        assert torch.equal(a, b)
    engine.destroy()
    ref.destroy()


def test_no_sync_accumulates_in_fp32_too():
    """DeepSpeed's no_sync pattern (gradient_accumulation_steps 1): the backwards inside add into the fp32 buffer,
    the one after it too, and that sum is what the boundary reduces."""
    engine = zerocore.initialize(_net(), {**_cfg(), "gradient_accumulation_steps": 1})
    model = _net().bfloat16()
    want = [torch.zeros(p.shape) for p in model.parameters()]
    for j in range(4):
        _loss(model, j).backward()
        for a, p in zip(want, model.parameters()):
            a.add_(p.grad)
        model.zero_grad(set_to_none=True)
        if j < 3:
            with engine.no_sync():
                engine.backward(_loss(engine, j))
        else:
            engine.backward(_loss(engine, j))
    for got, w in zip(_accumulated(engine), want):
        assert torch.equal(got, w)
    engine.step()
    engine.destroy()


def test_optimizer_offload_accumulates_in_bf16_as_deepspeeds_zero_optimizer():
    engine = zerocore.initialize(_net(), _cfg(offload_optimizer={"device": "cpu"}))
    assert engine.groups[0].grad_full.dtype == torch.bfloat16
    engine.destroy()


def test_coalesce_grad_reduction_accumulates_in_fp32_too():
    """(DeepSpeed's BF16 optimizer refuses coalesce_grad_reduction(); zerocore's stage 1 coalesces the same way
    whatever the buffer's dtype.)"""
    sums, _, _ = _reference(1)
    engine = zerocore.initialize(_net(), _cfg())
    with engine.coalesce_grad_reduction():
        for j in range(GAS):
            engine.set_gradient_accumulation_boundary(j == GAS - 1)
            engine.backward(_loss(engine, j))
    for got, want in zip(_accumulated(engine), sums[0]):
        assert torch.equal(got, want)
    engine.step()
    assert engine.optimizer_steps == 1
    engine.destroy()
