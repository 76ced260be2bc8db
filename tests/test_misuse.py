"""Misuse gets a named error and leaves nothing silently wrong (issue 15): what one process can
show here, and on spawned gloo ranks below (ranks that disagree are refused at start, every rank
raising the same error, within seconds)."""
from __future__ import annotations

import math
import os
import time
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import zerocore
from zerocore.config import load_config


def small_model(seed: int = 0, out: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, out))


def one_step(engine, x=None):
    x = torch.randn(4, 5) if x is None else x
    loss = engine(x.to(engine.dtype)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss


# -- learning rate and counters (items 4) --------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf"), "0.1", None])
def test_lr_setter_rejects_bad_values_and_keeps_the_old_one(bad):
    engine = zerocore.initialize(small_model(), {"optimizer": {"params": {"lr": 0.01}}})
    with pytest.raises((ValueError, TypeError), match="engine.lr must be"):
        engine.lr = bad
    assert engine.lr == 0.01
    engine.lr = torch.tensor(0.5)  # a scheduler's 0-dim tensor
    assert engine.lr == 0.5


@pytest.mark.parametrize("stage", [0, 2])
def test_a_failed_step_changes_no_counter_and_the_next_equals_a_clean_run(stage):
    cfg = {"zero_optimization": {"stage": stage}, "optimizer": {"params": {"lr": 0.01}}, "gradient_clipping": 0.0}
    clean, broken = small_model(), small_model()
    e_clean, e_broken = zerocore.initialize(clean, cfg), zerocore.initialize(broken, cfg)
    x = torch.randn(4, 5)
    one_step(e_clean, x)
    one_step(e_broken, x)
    # a failure inside the update (here: the optimizer's step raises once)
    shard = e_broken.shards[0]
    real = shard.step
    shard.step = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected failure in the update"))
    counters = (e_broken.micro_steps, e_broken.global_steps, e_broken.optimizer_steps, e_broken.skipped_steps)
    e_broken.backward(e_broken(x).pow(2).mean())
    with pytest.raises(RuntimeError, match="injected failure"):
        e_broken.step()
    assert (e_broken.micro_steps, e_broken.global_steps, e_broken.optimizer_steps,
            e_broken.skipped_steps) == counters
    shard.step = real
    e_broken.zero_grad()
    x2 = torch.randn(4, 5)
    one_step(e_clean, x2)
    one_step(e_broken, x2)
    assert e_broken.optimizer_steps == e_clean.optimizer_steps == 2
    for (n, a), b in zip(clean.state_dict().items(), broken.state_dict().values()):
        assert torch.equal(a, b), n  # Adam's step count was not advanced by the failed step


# -- engine use (backward argument, zero_grad between backward and step, input dtype) ---------------------
def test_backward_needs_the_loss_tensor():
    engine = zerocore.initialize(small_model(), {})
    with pytest.raises(TypeError, match=r"engine.backward\(loss\) needs the loss tensor .* got float 3.0"):
        engine.backward(3.0)
    with pytest.raises(ValueError, match=r"needs a scalar loss, got a tensor of shape \(4, 3\)"):
        engine.backward(engine(torch.randn(4, 5)))
    with torch.no_grad():
        detached = engine(torch.randn(4, 5)).sum()
    with pytest.raises(ValueError, match="does not require grad"):
        engine.backward(detached)
    one_step(engine)  # nothing was left half done
    assert engine.optimizer_steps == 1


def test_step_after_zero_grad_between_backward_and_step_says_what_happened():
    engine = zerocore.initialize(small_model(), {"zero_optimization": {"stage": 2}})
    engine.backward(engine(torch.randn(4, 5)).pow(2).mean())
    engine.zero_grad()
    with pytest.raises(RuntimeError, match=r"step\(\) without backward\(\).*zero_grad\(\) after the last backward\(\) "
                                           r"discarded its gradients"):
        engine.step()
    assert engine.micro_steps == 0 and engine.optimizer_steps == 0
    one_step(engine)
    assert engine.optimizer_steps == 1


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_wrong_input_dtype_names_both_dtypes(dtype):
    engine = zerocore.initialize(small_model(), {dtype: {"enabled": True}})
    name = {"bf16": "bfloat16", "fp16": "float16"}[dtype]
    with pytest.raises(RuntimeError, match=f"the engine holds the model in {name} and input #0 of the forward is "
                                           "float32; cast floating inputs"):
        engine(torch.randn(4, 5))
    one_step(engine)  # the right dtype still trains


# -- what initialize refuses (items 8, 10; meta; config re-validation) -------------------------------------
def test_meta_model_is_refused_naming_a_parameter():
    with torch.device("meta"):
        model = small_model()
    with pytest.raises(ValueError, match=r"parameter '0.weight' is on the meta device .*zerocore.init"):
        zerocore.initialize(model, {})


def test_initialize_twice_is_refused_until_destroy():
    model = small_model()
    first = zerocore.initialize(model, {"zero_optimization": {"stage": 2}})
    one_step(first)
    with pytest.raises(RuntimeError, match=r"parameter '0.weight' belongs to a live zerocore engine \(Engine at "
                                           r"0x[0-9a-f]+: stage 2, model Sequential, 1 optimizer steps\).*destroy"):
        zerocore.initialize(model, {"zero_optimization": {"stage": 2}})
    trained = {k: v.clone() for k, v in first.full_state_dict().items()}
    first.destroy()
    first.destroy()  # idempotent
    with pytest.raises(RuntimeError, match="this engine was destroyed"):
        first(torch.randn(2, 5))
    for k, v in model.state_dict().items():  # the model holds its trained values, in tensors of its own
        assert torch.equal(v, trained[k]), k
    with zerocore.initialize(model, {"zero_optimization": {"stage": 1}}) as second:
        one_step(second)  # the first engine's hooks are gone: no "gradient outside backward"
        assert second.optimizer_steps == 1
    zerocore.initialize(model, {})  # released by the context manager


def test_stage3_model_handed_to_a_second_engine_keeps_its_values():
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
    cfg = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_unit_min_params": 1}}
    with zerocore.initialize(model, cfg) as first:
        one_step(first, torch.randn(4, 64))
        trained = first.full_state_dict()
    assert all(p.numel() > 0 for p in model.parameters())
    assert type(model[0]) is nn.Linear  # stage 3's class swap is undone
    second = zerocore.initialize(model, cfg)
    assert sum(g.layout.numel for g in second.groups) == sum(v.numel() for v in trained.values())
    for k, v in second.full_state_dict().items():
        assert torch.equal(v, trained[k]), k
    one_step(second, torch.randn(4, 64))


def test_mutated_config_is_validated_at_initialize():
    cfg = load_config({"zero_optimization": {"stage": 1}})
    cfg.zero_optimization.stage = "3"
    with pytest.raises(zerocore.ConfigError, match="zero_optimization.stage: got the string '3'"):
        zerocore.initialize(small_model(), cfg)


def test_root_class_in_unit_classes_is_the_root_unit():
    model = small_model()
    engine = zerocore.initialize(model, {"zero_optimization": {"stage": 3, "stage3_unit_classes": ["Sequential"]}})
    one_step(engine)
    assert engine.optimizer_steps == 1
