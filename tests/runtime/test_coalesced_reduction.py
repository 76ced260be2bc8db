"""``engine.coalesce_grad_reduction()`` (DeepSpeed 0.19's; ``zerocore/runtime/coalesced_reduction.py``): the
backwards of a block reduce nothing and the block's end reduces their sum once. On 2 gloo ranks, at stages 1-3 and
1-3 with optimizer offload, blocks of 2, 4 and 3 micro-batches written as DeepSpeed's tests write them
(``set_gradient_accumulation_boundary(i == last)`` before each ``engine.backward``, ``step()`` after the block), one
variant with ``loss.backward()``, clipping that bites: every tensor and every step's global gradient norm match
one-process AdamW on the same global batches, and the reduction ran once per block. In one process: what DeepSpeed
refuses is refused (unmanaged accumulation, stage 0, ``step()`` inside, nesting with ``no_sync()``), and a block
left by an exception after its backwards makes ``step()`` refuse the window until ``zero_grad()``."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerocore
from stage3_ranks import LR, MICRO, WD, batch, scenarios_of, spawn
from window_reference import adamw_windows, assert_ranks_match

D, CLIP = 12, 0.05
BLOCKS = (2, 4, 3)
VARIANTS = {"stage1": (1, None, False), "stage2": (2, None, False), "stage3": (3, None, False),
            "stage1_offload": (1, "cpu", False), "stage2_offload": (2, "cpu", False),
            "stage3_offload": (3, "cpu", False), "stage2_loss_backward": (2, None, True),
            "stage3_loss_backward": (3, None, True)}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 27), nn.Tanh(), nn.Linear(27, 19), nn.Tanh(), nn.Linear(19, D))


def _cfg(stage: int, offload=None, gas: int = 1) -> dict:
    z = {"stage": stage, "reduce_bucket_size": 300}
    if stage == 3:
        z.update(stage3_param_persistence_threshold=0, stage3_unit_min_params=100)
    if offload:
        z["offload_optimizer"] = {"device": offload}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "gradient_clipping": CLIP,
            "zero_optimization": z, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}}


def _scenario(stage, offload, torch_style, rank, world) -> dict:
    engine = zerocore.initialize(_net(), _cfg(stage, offload))
    out = {"norms": [], "reductions": []}
    launches = []
    inner = engine.reducer._launch
    engine.reducer._launch = lambda k: (launches.append(k), inner(k))[1]
    try:
        i = 0
        for n in BLOCKS:
            before = len(launches)
            with engine.coalesce_grad_reduction():
                for j in range(n):
                    x, y = batch(i, MICRO * world, D)
                    lo = rank * MICRO
                    loss = nn.functional.mse_loss(engine(x[lo:lo + MICRO]), y[lo:lo + MICRO]) / n
                    engine.set_gradient_accumulation_boundary(j == n - 1)
                    loss.backward() if torch_style else engine.backward(loss)
                    i += 1
                    assert len(launches) == before, "a backward inside the block reduced"
            out["reductions"].append(len(launches) - before)
            engine.step()
            out["norms"].append(engine.global_grad_norm)
        out["params"] = engine.full_state_dict()
        out["groups"] = len(engine.groups)
        out["steps"] = engine.optimizer_steps
    finally:
        engine.destroy()
    return out


SCENARIOS = scenarios_of(globals(), _scenario, VARIANTS)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn(SCENARIOS, 2, tmp_path_factory.mktemp("coalesce"), timeout=400)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_one_reduction_per_block_and_adamws_numbers(ranks, name):
    want, norms = adamw_windows(_net, BLOCKS, D, CLIP)
    for r in assert_ranks_match(ranks, name, want, norms):
        assert r["reductions"] == [r["groups"]] * len(BLOCKS), f"{name}: each group reduced once per block"
        assert r["steps"] == len(BLOCKS)


def _train_block(engine, n=2):
    with engine.coalesce_grad_reduction():
        for i in range(n):
            x, y = batch(i, MICRO, D)
            engine.backward(nn.functional.mse_loss(engine(x), y))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_what_deepspeed_refuses_is_refused(stage):
    engine = zerocore.initialize(_net(), _cfg(stage))
    with pytest.raises(AssertionError, match="step\\(\\) inside coalesce_grad_reduction"):
        with engine.coalesce_grad_reduction():
            x, y = batch(0, MICRO, D)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
    engine.zero_grad()  # (the refused block left its gradients unreduced: the window is dropped)
    if stage == 1:
        with pytest.raises(AssertionError, match="nested"):
            with engine.no_sync(), engine.coalesce_grad_reduction():
                pass
        with pytest.raises(AssertionError, match="no_sync"):
            with engine.coalesce_grad_reduction(), engine.no_sync():
                pass
    _train_block(engine)
    engine.step()
    assert engine.optimizer_steps == 1
    engine.destroy()
    cfg = {**_cfg(stage), "managed_gradient_accumulation": False}
    engine = zerocore.initialize(_net(), cfg)
    with pytest.raises(AssertionError, match="coalesce_grad_reduction is not supported with managed"):
        with engine.coalesce_grad_reduction():
            pass
    engine.destroy()


def test_stage0_is_not_implemented():
    engine = zerocore.initialize(_net(), _cfg(0))
    with pytest.raises(NotImplementedError, match="stage 1/2/3"):
        with engine.coalesce_grad_reduction():
            pass
    engine.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_block_left_by_an_exception_is_not_stepped(stage):
    engine = zerocore.initialize(_net(), _cfg(stage))
    with pytest.raises(KeyError):
        with engine.coalesce_grad_reduction():
            x, y = batch(0, MICRO, D)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            raise KeyError("the user's loop failed")
    with pytest.raises(RuntimeError, match="left by an exception"):
        engine.step()
    engine.zero_grad()
    _train_block(engine)
    engine.step()
    assert engine.optimizer_steps == 1
    engine.destroy()


@pytest.mark.parametrize("stage", [2, 3])
def test_loss_backward_with_accumulation_inside_a_block_is_refused_at_stages_2_3(stage):
    engine = zerocore.initialize(_net(), _cfg(stage, gas=2))
    x, y = batch(0, MICRO, D)
    with pytest.raises(RuntimeError, match="engine.backward"):
        with engine.coalesce_grad_reduction():
            nn.functional.mse_loss(engine(x), y).backward()
    engine.zero_grad()
    with engine.coalesce_grad_reduction():
        engine.backward(nn.functional.mse_loss(engine(x), y))  # engine.backward divides the loss itself
    engine.step()
    engine.destroy()
