"""``managed_gradient_accumulation: false`` (DeepSpeed 0.19's; ``zerocore/runtime/unmanaged_window.py``): the
caller's ``step()`` ends each window after any number of ``backward()`` calls. On 2 gloo ranks, at stages 0-3 and
stages 1-3 with optimizer offload, windows of 2, 5 and 3 micro-batches (the config says 4), each loss divided by its
window's count (``scale_wrt_gas=False``), clipping that bites: every tensor and every step's global gradient norm
match one-process AdamW on the same global batches, every step() updates, and ``global_samples`` counts the
micro-batches the windows had. In one process: ``set_gradient_accumulation_boundary`` is refused, a step() without
a backward too; the DeepSpeed face refuses ``overlap_comm`` at stages 0/1 as DeepSpeed does, zerocore accepts it."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerocore
import zerocore.deepspeed as deepspeed
from stage3_ranks import LR, MICRO, WD, batch, scenarios_of, spawn
from window_reference import adamw_windows, assert_ranks_match

D, GAS, CLIP = 12, 4, 0.05
WINDOWS = (2, 5, 3)
VARIANTS = {"stage0": (0, None), "stage1": (1, None), "stage2": (2, None), "stage3": (3, None),
            "stage1_offload": (1, "cpu"), "stage2_offload": (2, "cpu"), "stage3_offload": (3, "cpu")}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 27), nn.Tanh(), nn.Linear(27, 19), nn.Tanh(), nn.Linear(19, D))


def _cfg(stage: int, offload=None, **extra) -> dict:
    z = {"stage": stage, "reduce_bucket_size": 300}
    if stage == 3:
        z.update(stage3_param_persistence_threshold=0, stage3_unit_min_params=100)
    if offload:
        z["offload_optimizer"] = {"device": offload}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
            "managed_gradient_accumulation": False, "zero_optimization": z,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}, **extra}


def _scenario(stage, offload, rank, world) -> dict:
    engine = zerocore.initialize(_net(), _cfg(stage, offload))
    out = {"norms": [], "applied": [], "samples": []}
    try:
        i = 0
        for n in WINDOWS:
            for _ in range(n):
                x, y = batch(i, MICRO * world, D)
                lo = rank * MICRO
                engine.backward(nn.functional.mse_loss(engine(x[lo:lo + MICRO]), y[lo:lo + MICRO]) / n,
                                scale_wrt_gas=False)
                i += 1
            engine.step()
            out["norms"].append(engine.global_grad_norm)
            out["applied"].append(engine.was_step_applied())
            out["samples"].append(engine.global_samples)
        out["params"] = engine.full_state_dict()
        out["steps"] = (engine.global_steps, engine.optimizer_steps)
    finally:
        engine.destroy()
    return out


SCENARIOS = scenarios_of(globals(), _scenario, VARIANTS)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn(SCENARIOS, 2, tmp_path_factory.mktemp("unmanaged"), timeout=400)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_step_ends_the_callers_window(ranks, name):
    want, norms = adamw_windows(_net, WINDOWS, D, CLIP)
    for r in assert_ranks_match(ranks, name, want, norms):
        assert r["applied"] == [True] * len(WINDOWS) and r["steps"] == (len(WINDOWS), len(WINDOWS))
        assert r["samples"] == [MICRO * 2 * sum(WINDOWS[:j + 1]) for j in range(len(WINDOWS))]  # 2 ranks


def test_misuse_is_named():
    engine = zerocore.initialize(_net(), _cfg(1))
    assert not engine.managed_gradient_accumulation()
    with pytest.raises(AssertionError, match="set_gradient_accumulation_boundary"):
        engine.set_gradient_accumulation_boundary(True)
    with pytest.raises(RuntimeError, match="step\\(\\) without backward"):
        engine.step()
    engine.destroy()
    assert zerocore.initialize(_net(), {"zero_optimization": {"stage": 1}}).managed_gradient_accumulation()


def test_overlap_comm_at_stages_0_1_is_refused_by_the_face_only():
    cfg = _cfg(1)
    cfg["zero_optimization"]["overlap_comm"] = True
    with pytest.raises(AssertionError, match="overlap_comm only with ZeRO stage 2"):
        deepspeed.initialize(model=_net(), config=cfg)
    engine = zerocore.initialize(_net(), cfg)  # zerocore's own: reduced in step(), nothing to overlap
    engine.backward(engine(torch.randn(MICRO, D)).square().mean())
    engine.step()
    assert engine.optimizer_steps == 1
    engine.destroy()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_managed_with_the_callers_boundary_matches(stage):
    """DeepSpeed's reference for the unmanaged mode: a managed engine told the boundary with
    set_gradient_accumulation_boundary may run a window's backwards before one step() (the twice-without-step
    refusal is for engines that count micro-batches themselves); it trains as the unmanaged engine does."""
    managed = zerocore.initialize(_net(), {**_cfg(stage), "managed_gradient_accumulation": True})
    unmanaged = zerocore.initialize(_net(), _cfg(stage))
    i = 0
    for n in WINDOWS:
        for micro in range(n):
            x, y = batch(i, MICRO, D)
            managed.set_gradient_accumulation_boundary(micro == n - 1)
            for e in (managed, unmanaged):
                e.backward(nn.functional.mse_loss(e(x), y) / n, scale_wrt_gas=False)
            i += 1
        managed.step()
        unmanaged.step()
        assert managed.global_grad_norm == pytest.approx(unmanaged.global_grad_norm, rel=1e-6)
    got, want = managed.full_state_dict(), unmanaged.full_state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")
    assert managed.optimizer_steps == unmanaged.optimizer_steps == len(WINDOWS)
    managed.destroy()
    unmanaged.destroy()
