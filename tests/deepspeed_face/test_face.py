"""The engine's DeepSpeed methods and the zerocore.deepspeed names, in one process (world 1)."""
from __future__ import annotations

import argparse
import json
import os
import warnings

import pytest
import torch
from torch.utils.data import TensorDataset

import zerocore
import zerocore.deepspeed as deepspeed
from zerocore.config import ConfigError


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def _cfg(stage=1, gas=2, **extra):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage}, **extra}


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(n)]


def _loss(engine, x, y):
    return torch.nn.functional.mse_loss(engine(x), y)


def test_initialize_returns_deepspeeds_four_and_the_facts():
    ds = TensorDataset(torch.randn(20, 6), torch.randn(20, 3))
    engine, opt, loader, sched = deepspeed.initialize(model=_model(), config=_cfg(), training_data=ds)
    assert isinstance(engine, deepspeed.DeepSpeedEngine) and isinstance(engine, zerocore.Engine)
    assert isinstance(engine, deepspeed.runtime.engine.DeepSpeedEngine)
    assert loader is engine.training_dataloader and len(loader) == 5
    assert (engine.zero_optimization_stage(), engine.gradient_accumulation_steps(),
            engine.train_micro_batch_size_per_gpu(), engine.train_batch_size()) == (1, 2, 4, 8)
    assert (engine.global_rank, engine.local_rank, engine.world_size, engine.dp_world_size) == (0, 0, 1, 1)
    assert engine.device == torch.device("cpu") and not engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert engine.get_global_grad_norm() is None and engine.global_samples == 0
    assert engine.train() is engine and engine.module.training
    engine.eval()
    assert not engine.module.training


def test_backward_scales_by_accumulation_and_step_updates_at_the_boundary():
    engine = zerocore.initialize(_model(), _cfg(gas=2))
    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    for i, (x, y) in enumerate(_batches(6)):
        loss = _loss(engine, x, y)
        assert engine.is_gradient_accumulation_boundary() == (i % 2 == 1)
        ret = engine.backward(loss)
        assert ret.item() == pytest.approx(loss.item() / 2)  # DeepSpeed returns the gas-scaled loss
        engine.step()
        (torch.nn.functional.mse_loss(ref(x), y) / 2).backward()
        if i % 2 == 1:
            ref_opt.step()
            ref_opt.zero_grad()
    assert (engine.global_steps, engine.global_samples, engine.skipped_steps) == (3, 24, 0)
    for p, q in zip(engine.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_scale_wrt_gas_false_does_not_divide():
    a, b = zerocore.initialize(_model(), _cfg(gas=2)), zerocore.initialize(_model(), _cfg(gas=2))
    for x, y in _batches(2):
        a.backward(_loss(a, x, y))
        a.step()
        loss = _loss(b, x, y) / 2
        assert b.backward(loss, scale_wrt_gas=False) is loss  # returned as given, as DeepSpeed does
        b.step()
    assert b.global_steps == 1
    for p, q in zip(a.module.parameters(), b.module.parameters()):
        torch.testing.assert_close(p, q)


def test_set_gradient_accumulation_boundary_overrides_the_counter():
    engine = zerocore.initialize(_model(), _cfg(gas=4))
    batches = _batches(3)
    engine.set_gradient_accumulation_boundary(False)
    for x, y in batches[:2]:
        engine.backward(_loss(engine, x, y))
        engine.step()
    assert engine.global_steps == 0 and not engine.is_gradient_accumulation_boundary()
    engine.set_gradient_accumulation_boundary(True)
    x, y = batches[2]
    engine.backward(_loss(engine, x, y))
    engine.step()  # three micro-batches, then the update: the caller owns the boundary
    assert engine.global_steps == 1
    with pytest.raises(TypeError, match="bool"):
        engine.set_gradient_accumulation_boundary(1)


@pytest.mark.parametrize("stage", [1, 3])
def test_windows_the_boundary_ends_early_are_whole(stage, tmp_path):
    # a trainer's epoch of 5 micro-batches with accumulation 2: windows of 2, 2, then 1 (issue 34);
    # after each update the engine is between windows, though micro_steps is not a multiple of 2
    engine = zerocore.initialize(_model(), _cfg(stage=stage, gas=2))
    for i, (x, y) in enumerate(_batches(5)):
        engine.set_gradient_accumulation_boundary(i in (1, 3, 4))
        engine.backward(_loss(engine, x, y))
        engine.step()
    assert (engine.micro_steps, engine.global_steps) == (5, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "zero_grad() inside a gradient accumulation window" warning
        engine.module.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "in the middle of gradient accumulation" warning
        engine.save_checkpoint(str(tmp_path), tag="after_short")
    engine.set_gradient_accumulation_boundary(False)
    engine.backward(_loss(engine, *_batches(1)[0]))
    engine.step()
    with pytest.warns(RuntimeWarning, match="middle of gradient accumulation"):  # allowed, as DeepSpeed allows it
        engine.save_checkpoint(str(tmp_path), tag="inside")
    # a load lands on a boundary: the window starts there (micro_steps becomes 3 x 2)
    engine.load_checkpoint(str(tmp_path), tag="after_short")
    assert (engine.micro_steps, engine.global_steps) == (6, 3)
    engine.save_checkpoint(str(tmp_path), tag="reloaded")


@pytest.mark.parametrize("stage", [0, 1])
def test_no_sync_accumulates_like_accumulation_steps(stage):
    a = zerocore.initialize(_model(), _cfg(stage=stage, gas=1))
    b = zerocore.initialize(_model(), _cfg(stage=stage, gas=1))
    batches = _batches(3)
    with a.no_sync():
        for x, y in batches[:2]:
            a.backward(_loss(a, x, y))
        with pytest.raises(RuntimeError, match="step\\(\\) inside no_sync"):
            a.step()
        with pytest.raises(RuntimeError, match="nesting"):
            with a.no_sync():
                pass
    a.backward(_loss(a, *batches[2]))
    a.step()
    # the same three micro-batches summed by the boundary override: no_sync only skips the reduction
    b.set_gradient_accumulation_boundary(False)
    for x, y in batches[:2]:
        b.backward(_loss(b, x, y))
        b.step()
    b.set_gradient_accumulation_boundary(True)
    b.backward(_loss(b, *batches[2]))
    b.step()
    assert a.global_steps == b.global_steps == 1
    for p, q in zip(a.module.parameters(), b.module.parameters()):
        torch.testing.assert_close(p, q)


@pytest.mark.parametrize("stage", [2, 3])
def test_no_sync_is_refused_where_gradients_are_partitioned(stage):
    engine = zerocore.initialize(_model(), _cfg(stage=stage))
    with pytest.raises(RuntimeError, match=f"no_sync\\(\\) is incompatible with ZeRO stage {stage}"):
        with engine.no_sync():
            pass


def test_checkpoint_signatures_save_latest_and_nothing_to_load(tmp_path):
    engine = zerocore.initialize(_model(), _cfg(gas=1))
    for x, y in _batches(2):
        engine.backward(_loss(engine, x, y))
        engine.step()
    assert engine.load_checkpoint(str(tmp_path / "none")) == (None, None)
    engine.save_checkpoint(str(tmp_path), tag="first", client_state={"k": 1})
    engine.save_checkpoint(str(tmp_path), tag="second", save_latest=False)
    assert (tmp_path / "latest").read_text() == "first"
    path, client = engine.load_checkpoint(str(tmp_path), load_module_strict=True, load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    assert path.endswith("first") and client == {"k": 1} and engine.global_samples == 8
    with pytest.raises(ValueError, match="load_module_strict=False"):
        engine.load_checkpoint(str(tmp_path), load_module_strict=False)


def test_zero_to_fp32_reads_zerocore_checkpoints(tmp_path):
    from zerocore.deepspeed.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                                       get_fp32_state_dict_from_zero_checkpoint)
    engine = zerocore.initialize(_model(), _cfg(stage=2, gas=1))
    for x, y in _batches(2):
        engine.backward(_loss(engine, x, y))
        engine.step()
    engine.save_checkpoint(str(tmp_path / "ck"))
    full = engine.full_state_dict()
    got = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ck"))
    assert got.keys() == full.keys() and all(torch.equal(got[k], full[k]) for k in full)
    files = convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ck"), str(tmp_path / "out"))
    assert files == [str(tmp_path / "out" / "pytorch_model.bin")]
    loaded = torch.load(files[0])
    assert all(torch.equal(loaded[k], full[k]) for k in full)
    files = convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ck"), str(tmp_path / "st"),
                                                       safe_serialization=True)
    assert files[0].endswith("model.safetensors")


def test_zero3_consolidated_16bit_state_dict():
    engine = zerocore.initialize(_model(), _cfg(stage=3, gas=1))
    sd = engine._zero3_consolidated_16bit_state_dict()
    assert list(sd) == list(_model().state_dict()) and all(torch.equal(sd[k], v) for k, v in
                                                             engine.full_state_dict().items())
    with pytest.raises(ValueError, match="requires ZeRO stage 3"):
        zerocore.initialize(_model(), _cfg(stage=2))._zero3_consolidated_16bit_state_dict()


def test_zero_init_and_gathered_parameters():
    cfg = _cfg(stage=3, gas=1)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition even these small ones
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = _model()
    assert model[0].weight.numel() == 0  # partitioned while built
    engine = zerocore.initialize(model, cfg)
    with deepspeed.zero.GatheredParameters(model[0].weight, modifier_rank=0):
        assert model[0].weight.shape == (12, 6)
        with torch.no_grad():
            model[0].weight.zero_()
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        assert torch.count_nonzero(model[0].weight) == 0
    with deepspeed.zero.GatheredParameters([model[0].weight], enabled=False):
        assert model[0].weight.numel() == 0
    del engine


def test_config_and_args_sources(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_cfg()))
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    assert args.deepspeed and args.deepspeed_config == str(path)
    engine, *_ = deepspeed.initialize(args=args, model=_model())
    assert engine.gradient_accumulation_steps() == 2
    engine, *_ = deepspeed.initialize(model=_model(), config_params=_cfg(gas=3))
    assert engine.gradient_accumulation_steps() == 3
    with pytest.raises(ValueError, match="both in args.deepspeed_config"):
        deepspeed.initialize(args=args, model=_model(), config=_cfg())
    with pytest.raises(ValueError, match="no config"):
        deepspeed.initialize(model=_model())


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="mpu .*not supported"):
        deepspeed.initialize(model=_model(), config=_cfg(), mpu=object())
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer.*got str"):
        cfg = _cfg()
        del cfg["optimizer"]
        deepspeed.initialize(model=_model(), config=cfg, optimizer="adam")
    m = _model()
    sgd = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="the passed one is used and the section is ignored, as DeepSpeed does"):
        # DeepSpeed accepts both (SGD at a ZeRO stage once zero_allow_untested_optimizer says so)
        engine, opt, *_ = deepspeed.initialize(model=m, config={**_cfg(), "zero_allow_untested_optimizer": True},
                                               optimizer=sgd)
    assert engine.client_optimizer is sgd and opt is engine.optimizer and opt.optimizer is sgd
    with pytest.raises(ValueError, match="training_data must be a torch.utils.data.Dataset"):
        deepspeed.initialize(model=_model(), config=_cfg(), training_data=[1, 2, 3])


def test_top_level_keys_that_change_training_are_refused():
    from zerocore.config import load_config
    with pytest.raises(ConfigError, match="^pipeline: zerocore does not implement"):
        load_config({"pipeline": {"stages": 2}})
    with pytest.raises(ConfigError, match="prescale_gradients: got True"):
        load_config({"prescale_gradients": True})
    with pytest.warns(UserWarning, match="tensorboard.*activation_checkpointing"):
        load_config({"tensorboard": {"enabled": True}, "activation_checkpointing": {"partition_activations": True},
                     "elasticity": {"enabled": False}, "prescale_gradients": False})


def test_comm_accelerator_and_ops_faces():
    assert (deepspeed.comm.get_rank(), deepspeed.comm.get_world_size(), deepspeed.comm.get_local_rank()) == (0, 1, 0)
    t = torch.ones(3)
    deepspeed.comm.all_reduce(t)
    out = torch.empty(3)
    deepspeed.comm.all_gather_into_tensor(out, t)
    assert torch.equal(out, t)
    acc = deepspeed.accelerator.get_accelerator()
    assert acc.device_name() in ("cpu", "cuda") and acc.is_available() and acc.device_count() >= 1
    assert acc.communication_backend_name() in ("gloo", "nccl")
    from zerocore.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    opt = FusedAdam(_model().parameters())
    assert opt.param_groups[0]["weight_decay"] == 0.0  # DeepSpeed's default, not torch AdamW's 0.01
    assert isinstance(DeepSpeedCPUAdam(_model().parameters()), zerocore.FusedAdam)
    with pytest.raises(ValueError, match="amsgrad"):
        FusedAdam(_model().parameters(), amsgrad=True)
    from zerocore.deepspeed.runtime import lr_schedules
    assert lr_schedules.WARMUP_DECAY_LR == "WarmupDecayLR" and "OneCycle" in lr_schedules.VALID_LR_SCHEDULES


def test_checkpointing_face_recomputes_the_same_values():
    torch.manual_seed(0)
    lin = torch.nn.Linear(5, 5)
    x = torch.randn(3, 5, requires_grad=True)
    y = deepspeed.checkpointing.checkpoint(lambda t: torch.tanh(lin(t)), x)
    y.sum().backward()
    g = x.grad.clone()
    x.grad = None
    torch.tanh(lin(x)).sum().backward()
    assert torch.equal(g, x.grad)


needs_groups = pytest.mark.skipif("lr_scheduler" not in __import__("inspect").signature(zerocore.initialize).parameters,
                                  reason="needs parameter groups and schedules in the engine")


@needs_groups
def test_bad_groups_and_schedules_are_named_through_the_face():
    with pytest.raises(ConfigError, match="scheduler.type: got 'Nope'"):
        deepspeed.initialize(model=_model(), config=_cfg(scheduler={"type": "Nope", "params": {}}))
    with pytest.raises(ConfigError, match="scheduler.params.total_num_steps: required by WarmupDecayLR"):
        deepspeed.initialize(model=_model(), config=_cfg(scheduler={"type": "WarmupDecayLR",
                                                                    "params": {"warmup_num_steps": 3}}))
    with pytest.raises(ValueError, match=r"model_parameters\[0\] has no 'params' key"):
        deepspeed.initialize(model=_model(), config=_cfg(), model_parameters=[{"lr": 0.1}])
    m = _model()
    with pytest.raises(ValueError, match="'0.weight' is in two groups"):
        deepspeed.initialize(model=m, config=_cfg(), model_parameters=[{"params": list(m.parameters())},
                                                                       {"params": [m[0].weight]}])


@needs_groups
def test_scheduler_steps_at_boundaries_and_lr_kwargs_reach_it():
    cfg = _cfg(gas=2, scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                                "warmup_num_steps": 4, "warmup_type": "linear"}})
    engine, opt, _, sched = deepspeed.initialize(model=_model(), config=cfg)
    assert sched is engine.lr_scheduler and opt is engine.optimizer
    lrs = []
    for x, y in _batches(6):
        engine.backward(_loss(engine, x, y))
        engine.step()
        lrs.append(engine.get_lr()[0])
    # one schedule step per accumulation boundary; DeepSpeed's WarmupLR is at iteration 0 (min lr) after the first
    assert lrs == pytest.approx([0.0, 0.0, 0.0, 0.0025, 0.0025, 0.005], abs=1e-12)
    seen = []

    class Recording(torch.optim.lr_scheduler.LambdaLR):
        def step(self, epoch=None, **kwargs):
            seen.append(kwargs)
            super().step(epoch)

    engine, _, _, _ = deepspeed.initialize(model=_model(), config=_cfg(gas=1),
                                           lr_scheduler=lambda o: Recording(o, lambda s: 1.0))
    seen.clear()
    engine.backward(_loss(engine, *_batches(1)[0]))
    engine.step(lr_kwargs={})
    assert seen == [{}]


@pytest.mark.parametrize("drop_last", [False, True])
def test_training_loader_yields_deepspeeds_micro_batches(drop_last, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    dataloader = pytest.importorskip("deepspeed.runtime.dataloader", reason="comparing with DeepSpeed's loader")
    from types import SimpleNamespace

    from zerocore.runtime.deepspeed_methods import build_dataloader
    data = TensorDataset(torch.arange(23.0).unsqueeze(1), torch.arange(23))
    for rank in range(2):
        theirs = dataloader.DeepSpeedDataLoader(data, batch_size=4, pin_memory=False, local_rank=rank, tput_timer=None,
                                                num_local_io_workers=0, data_parallel_world_size=2,
                                                data_parallel_rank=rank, dataloader_drop_last=drop_last)
        ours = build_dataloader(data, 4, SimpleNamespace(world=2, rank=rank), drop_last=drop_last)
        assert len(ours) == len(theirs)
        for epoch in range(2):  # the same order every epoch, as DeepSpeed's (no set_epoch)
            a, b = list(ours), list(theirs)
            assert len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
                                            for x, y in zip(a, b))


def test_compile_and_destroy():
    engine = zerocore.initialize(_model(), _cfg(stage=2, gas=1))
    x, y = _batches(1)[0]
    before = engine(x).detach()
    engine.compile(backend="eager")
    assert engine.is_compiled
    torch.testing.assert_close(engine(x), before)
    engine.backward(_loss(engine, x, y))
    engine.step()
    model = engine.module
    engine.destroy()
    assert engine.module is None and isinstance(model, torch.nn.Module)
