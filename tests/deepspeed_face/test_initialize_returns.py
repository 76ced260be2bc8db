"""What deepspeed.initialize returns and refuses as DeepSpeed's does (issue 34): the basic optimizer
at stage 0 without mixed precision (the client's, or a FusedAdam for an Adam section), the engine's
face otherwise, engine.optimizer.optimizer; DeepSpeed's own refusals with its exception types."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

import zerocore
import zerocore.deepspeed as deepspeed
from zerocore.deepspeed.ops.adam import FusedAdam


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _cfg(stage=0, **extra):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
            **extra}


def _train(engine, steps=3):
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x = torch.randn(4, 6, generator=g).to(engine.dtype)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    return engine.full_state_dict()


@pytest.mark.parametrize("adam", [{"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.1}},
                                  {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.1, "adam_w_mode": False}},
                                  {"type": "AdamW", "params": {"lr": 0.02}}])
def test_stage0_returns_a_fused_adam_for_an_adam_section_and_trains_as_zerocore(adam):
    engine, opt, _, _ = deepspeed.initialize(model=_model(), config=_cfg(optimizer=adam))
    assert isinstance(opt, FusedAdam) and opt is engine.optimizer.optimizer is engine.client_optimizer
    assert opt.param_groups is engine.optimizer.param_groups  # one set of values: edits reach the engine
    want = _train(zerocore.initialize(_model(), _cfg(optimizer=adam)))  # zerocore's own path, same section
    got = _train(engine)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_stage0_returns_the_client_optimizer_itself():
    model = _model()
    client = torch.optim.AdamW(model.parameters(), lr=0.01)
    _, opt, _, _ = deepspeed.initialize(model=model, config=_cfg(), optimizer=client)
    assert opt is client
    _, opt, _, _ = deepspeed.initialize(model=_model(), config=_cfg(),
                                        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert isinstance(opt, torch.optim.SGD)


@pytest.mark.parametrize("stage, extra", [(1, {}), (2, {}), (3, {}), (0, {"bf16": {"enabled": True}})])
def test_with_zero_or_mixed_precision_the_engines_optimizer_is_returned(stage, extra):
    from zerocore.runtime.shard_view import ShardAdamView

    engine, opt, _, _ = deepspeed.initialize(model=_model(), config=_cfg(stage, optimizer={"type": "Adam"}, **extra))
    assert opt is engine.optimizer
    # the basic optimizer DeepSpeed keeps under its wrapper: this rank's Adam state over the flat fp32 pieces
    inner = opt.optimizer
    assert isinstance(inner, ShardAdamView) and opt.optimizer is inner
    _train(engine, steps=2)
    pieces = [p for g in inner.param_groups for p in g["params"]]
    assert sum(p.numel() for p in pieces) == sum(s.master.numel() for s in engine.shards)
    for p in pieces:
        st = inner.state[p]
        assert st["step"].item() == engine.optimizer_steps == 2 and st["exp_avg"].shape == p.shape
        assert st["exp_avg_sq"].min() >= 0 and st["exp_avg"].abs().sum() > 0
    opt.param_groups[0]["lr"] = 0.5  # the view shows the face's values as they are now
    assert inner.param_groups[0]["lr"] == 0.5
    sd = inner.state_dict()  # torch's layout, pieces numbered in group order
    assert [g["params"] for g in sd["param_groups"]] == [list(range(len(pieces)))] and sd["param_groups"][0]["lr"] == 0.5
    assert all(torch.equal(sd["state"][i]["exp_avg"], inner.state[p]["exp_avg"]) for i, p in enumerate(pieces))
    model = _model()
    client = torch.optim.AdamW(model.parameters(), lr=0.01)
    engine, opt, _, _ = deepspeed.initialize(model=model, config=_cfg(stage, **extra), optimizer=client)
    assert opt is engine.optimizer and opt.optimizer is client


def test_a_schedule_over_another_optimizer_is_taken_as_deepspeed_takes_it():
    model = _model()
    other = LambdaLR(torch.optim.Adam(model.parameters()), lambda e: 1.0)
    with pytest.warns(UserWarning, match="schedules another optimizer"):
        engine, _, _, sched = deepspeed.initialize(model=model, config=_cfg(optimizer={"type": "Adam"}),
                                                   lr_scheduler=other)
    assert sched is other and engine.lr_scheduler is other


@pytest.mark.parametrize("size, stage, refused", [(1001, 1, True), (1001, 2, True), (1000, 2, False),
                                                  (1001, 3, False), (1001, 0, False)])
def test_allgather_bucket_size_must_be_even_at_stages_1_and_2(size, stage, refused):
    cfg = _cfg(stage, optimizer={"type": "Adam"})
    cfg["zero_optimization"]["allgather_bucket_size"] = size
    if refused:
        with pytest.raises(AssertionError, match="allgather_bucket_size must be a multiple of "
                                                 "nccl_start_alignment_factor"):
            deepspeed.initialize(model=_model(), config=cfg)
    else:
        deepspeed.initialize(model=_model(), config=cfg)


def test_an_unsupported_dtype_mix_without_zero_is_not_implemented():
    cfg = _cfg(0, optimizer={"type": "Adam"}, bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    with pytest.raises(NotImplementedError, match="unsupported mix"):
        deepspeed.initialize(model=_model(), config=cfg)
    with pytest.raises(deepspeed.DeepSpeedConfigError):  # a config error too
        deepspeed.initialize(model=_model(), config=cfg)
    cfg["zero_optimization"]["stage"] = 2  # DeepSpeed's ZeRO accumulates in bf16 whatever it says: accepted
    deepspeed.initialize(model=_model(), config=cfg)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_second_initialize_of_the_same_model_takes_it_over(stage):
    """DeepSpeed wraps a model again; here the first engine gives it back (destroy) with a warning, and
    the second starts from the trained values. zerocore.initialize itself keeps refusing."""
    model = _model()
    first, *_ = deepspeed.initialize(model=model, config=_cfg(stage, optimizer={"type": "Adam"}))
    trained = _train(first, steps=2)
    with pytest.raises(RuntimeError, match="belongs to a live zerocore engine"):
        zerocore.initialize(model, _cfg(stage, optimizer={"type": "Adam"}))
    with pytest.warns(UserWarning, match="belongs to a live engine .*it is destroyed"):
        second, *_ = deepspeed.initialize(model=model, config=_cfg(stage, optimizer={"type": "Adam"}))
    got = second.full_state_dict()
    assert all(torch.equal(got[k], trained[k]) for k in trained)
    with pytest.raises(RuntimeError, match=r"destroy\(\)"):
        first(torch.randn(4, 6))
    _train(second)  # trains alone: the first engine's hooks are gone


def test_the_basic_optimizers_state_round_trips_through_a_checkpoint(tmp_path):
    """DeepSpeed's elastic-checkpoint test compares engine.optimizer.optimizer.state_dict() before a
    save and after a load: the same here (exact moments and step, the same groups)."""
    import io

    cfg = _cfg(2, optimizer={"type": "Adam", "params": {"lr": 0.01}})
    engine, *_ = deepspeed.initialize(model=_model(), config=cfg)
    _train(engine, steps=3)
    buf = io.BytesIO()
    torch.save(engine.optimizer.optimizer.state_dict(), buf)
    engine.save_checkpoint(str(tmp_path))
    fresh, *_ = deepspeed.initialize(model=_model(1), config=cfg)
    fresh.load_checkpoint(str(tmp_path))
    buf.seek(0)
    saved, now = torch.load(buf), fresh.optimizer.optimizer.state_dict()
    assert saved["param_groups"] == now["param_groups"] and saved["state"].keys() == now["state"].keys()
    for i, st in saved["state"].items():
        assert all(torch.equal(st[k], now["state"][i][k]) for k in ("step", "exp_avg", "exp_avg_sq")), i
