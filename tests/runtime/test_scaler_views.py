"""DeepSpeed's names for the loss scale on ``engine.optimizer`` (runtime/scaler_views.py): ``loss_scaler`` as its
ZeRO optimizers' scaler, ``loss_scale_config`` as its stage-0 optimizers', ``loss_scale`` / ``cur_scale``; read
from the engine's scaler when asked, through an fp16 run with overflows."""
from __future__ import annotations

import gc

import pytest
import torch

import zerocore


def _engine(stage: int, fp16: dict):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return zerocore.initialize(model, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
                                       "fp16": {"enabled": True, **fp16}})


def _step(engine, overflow: bool) -> None:
    x = torch.randn(2, 6)
    if overflow:
        x[0, 0] = float("inf")
    engine.backward(engine(x.half()).float().square().mean())
    engine.step()


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_dynamic_views_follow_the_engines_scaler(stage):
    e = _engine(stage, {"loss_scale": 0, "initial_scale_power": 6, "loss_scale_window": 2, "hysteresis": 2,
                        "min_loss_scale": 0.5})
    opt = e.optimizer
    scaler, cfg = opt.loss_scaler, opt.loss_scale_config
    assert opt.dynamic_loss_scale and scaler.dynamic and cfg.dynamic_loss_scale and cfg.use_grad_scaling
    assert opt.loss_scale == opt.cur_scale == scaler.cur_scale == scaler.loss_scale == cfg.cur_scale == 64
    assert (scaler.scale_window, cfg.scale_window, scaler.min_scale, cfg.min_loss_scale) == (2, 2, 0.5, 0.5)
    assert (scaler.scale_factor, cfg.scale_factor, scaler.delayed_shift, scaler.cur_hysteresis) == (2.0, 2.0, 2, 2)
    assert scaler.consecutive_hysteresis is False and scaler.raise_error_at_min_scale is False
    assert scaler.cur_iter == cfg.cur_iter == 0 and scaler.last_overflow_iter == cfg.last_overflow_iter == -1
    _step(e, overflow=True)
    # stage 0: every overflow halves (DeepSpeed's stage-0 optimizers); ZeRO stages: hysteresis 2 absorbs one
    assert scaler.cur_scale == (32 if stage == 0 else 64) and scaler.cur_iter == cfg.cur_iter == 1
    assert scaler.last_overflow_iter == 0 and e.skipped_steps == 1
    assert scaler.cur_hysteresis == (2 if stage == 0 else 1)
    for _ in range(3):
        _step(e, overflow=False)
    assert scaler.cur_scale == (64 if stage == 0 else 128)  # window + 1 clean steps: doubled once
    assert cfg.cur_iter == 4 and e.skipped_steps == 1
    e.destroy()


def test_cur_scale_may_be_set_the_rest_is_read_only():
    e = _engine(2, {"loss_scale": 0, "initial_scale_power": 4})
    opt = e.optimizer
    opt.loss_scaler.cur_scale = 512
    assert e.scaler.scale == opt.loss_scale == 512.0
    opt.loss_scale = 256.0
    opt.loss_scale_config.cur_scale = 128
    assert opt.cur_scale == 128.0
    for bad in (0, -1.0, float("inf"), float("nan"), "8", True):
        with pytest.raises(ValueError, match="positive finite number"):
            opt.loss_scaler.cur_scale = bad
    assert opt.cur_scale == 128.0  # nothing changed by the refused values
    with pytest.raises(AttributeError, match="read-only"):
        opt.loss_scaler.scale_window = 3
    with pytest.raises(AttributeError, match="read-only"):
        opt.loss_scale_config.cur_iter = 3
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        opt.loss_scaler.nonsense
    e.destroy()


def test_fixed_scale_has_deepspeeds_static_names_only():
    e = _engine(1, {"loss_scale": 128})
    opt = e.optimizer
    assert not opt.dynamic_loss_scale and opt.loss_scaler.cur_scale == opt.loss_scale == 128
    with pytest.raises(AttributeError, match="the loss scale is fixed"):
        opt.loss_scaler.scale_window
    with pytest.raises(AttributeError, match="the loss scale is fixed"):
        opt.loss_scaler.scale_factor
    cfg = opt.loss_scale_config
    assert cfg.use_grad_scaling and not cfg.dynamic_loss_scale and cfg.cur_scale == 128
    assert (cfg.scale_window, cfg.min_loss_scale, cfg.scale_factor, cfg.last_overflow_iter) == (None,) * 4
    _step(e, overflow=False)
    assert cfg.cur_iter == 1 == e.global_steps
    e.destroy()


def test_bf16_reports_no_grad_scaling_and_a_view_outliving_its_engine_says_so():
    torch.manual_seed(0)
    e = zerocore.initialize(torch.nn.Linear(4, 4), {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}})
    cfg, scaler = e.optimizer.loss_scale_config, e.optimizer.loss_scaler
    assert not cfg.use_grad_scaling and cfg.cur_scale == 1.0 and not scaler.dynamic
    with pytest.raises(ValueError, match="only fp16 training is loss-scaled"):
        e.optimizer.cur_scale = 128
    assert e.scaler.scale == 1.0 and not e.scaler.needed
    e.destroy()
    del e
    gc.collect()
    with pytest.raises(RuntimeError):
        cfg.cur_scale
    with pytest.raises(RuntimeError):
        scaler.cur_scale


def test_checkpoint_does_not_carry_the_stage_rule(tmp_path):
    """The stage-0 rule (no hysteresis) is the engine's, not the saved state's: a stage-1 engine loading a
    stage-0 checkpoint keeps its hysteresis."""
    e0 = _engine(0, {"loss_scale": 0, "initial_scale_power": 6, "hysteresis": 2})
    _step(e0, overflow=False)
    e0.save_checkpoint(str(tmp_path), tag="t")
    e0.destroy()
    e1 = _engine(1, {"loss_scale": 0, "initial_scale_power": 6, "hysteresis": 2})
    e1.load_checkpoint(str(tmp_path), tag="t")
    assert e1.scaler.hysteresis_applies and e1.optimizer.loss_scaler.cur_iter == 1
    _step(e1, overflow=True)
    assert e1.optimizer.cur_scale == 64  # hysteresis absorbed it
    e1.destroy()
