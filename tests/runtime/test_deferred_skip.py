"""bf16's Inf/NaN check decided on the device and read a step later (zerocore/runtime/deferred_skip.py).

DeepSpeed's rule (``bf16.check_grad_overflow``, on by default): a boundary with Inf/NaN gradients skips
its update, counts in ``skipped_steps`` and does not step the engine's lr schedule. Here the Adam kernel
skips on the device and the host takes its counts and the schedule's step back when it reads the flag.
Checked: the skipped update writes nothing; the training equals one where that boundary never happened
(Adam's step count and the schedule included), whether the host reads the decision at once or only at
the next step; a schedule that cannot be copied makes the step read it at once; the counts are true
after ``destroy()`` and in a checkpoint.
"""
from __future__ import annotations

import contextlib
import copy
import threading

import pytest
import torch

import zerocore

STEPS, INF_AT = 5, 2
SCHEDULE = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 10}}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def _config(stage: int, **kw) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5, "bf16": {"enabled": True},
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}, "scheduler": SCHEDULE, **kw}


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 16, generator=g).to(torch.bfloat16), torch.randn(4, 4, generator=g)


def _inf_grad(engine):
    return engine.module[2].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))


def _backward(engine, step: int, *, inf: bool = False) -> torch.Tensor:
    """One micro-batch's forward and backward; ``inf``: an Inf in one element of a gradient."""
    x, y = _batch(step)
    loss = torch.nn.functional.mse_loss(engine(x).float(), y)
    hook = _inf_grad(engine) if inf else None
    engine.backward(loss)
    if hook is not None:
        hook.remove()
    return loss


def train(stage: int, *, read_each_step: bool, inf_at: int | None = INF_AT, drop_at: int | None = None,
          config: dict | None = None, engine_kw: dict | None = None) -> dict:
    """STEPS boundaries; at ``inf_at`` an Inf in one gradient element; at ``drop_at`` the boundary's
    gradients are dropped instead of stepped (the boundary that never happened)."""
    engine = zerocore.initialize(_model(), config or _config(stage), **(engine_kw or {}))
    out = {"lrs": [], "losses": [], "around_skip": None}
    for step in range(STEPS):
        out["losses"].append(_backward(engine, step, inf=step == inf_at).item())
        if step == drop_at:
            engine.zero_grad()
            continue
        if step == inf_at:
            before = {k: v.clone() for k, v in engine.full_state_dict().items()}
            engine.step()
            out["around_skip"] = (before, engine.full_state_dict())
        else:
            engine.step()
        if read_each_step:
            out["lrs"].append(engine.get_lr()[0])
            engine.skipped_steps  # noqa: B018 - the read settles the decision now
    out["lr"] = engine.get_lr()[0]
    out["state"] = engine.full_state_dict()
    out["counts"] = (engine.optimizer_steps, engine.skipped_steps, engine.overflow)
    out["engine"] = engine
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_skipped_boundary_trains_as_if_it_never_happened(stage):
    with pytest.warns(RuntimeWarning, match=f"at step {INF_AT + 1}; the update was skipped"):
        lazy = train(stage, read_each_step=False)
    before, after = lazy["around_skip"]
    assert all(torch.equal(before[k], after[k]) for k in before), "the skipped update wrote parameters"
    never = train(stage, read_each_step=False, inf_at=None, drop_at=INF_AT)
    assert all(torch.equal(lazy["state"][k], never["state"][k]) for k in never["state"]), \
        "Adam's step count or the lr after the skipped boundary differs from a run without it"
    assert lazy["lr"] == never["lr"]
    assert lazy["counts"] == (STEPS - 1, 1, False) and never["counts"] == (STEPS - 1, 0, False)
    for r in (lazy, never):
        r["engine"].destroy()


def test_reading_the_decision_at_once_or_a_step_later_gives_the_same_training():
    with pytest.warns(RuntimeWarning, match="the update was skipped"):
        eager = train(2, read_each_step=True)
    with pytest.warns(RuntimeWarning, match="the update was skipped"):
        lazy = train(2, read_each_step=False)
    assert eager["losses"] == lazy["losses"] and eager["lr"] == lazy["lr"] and eager["counts"] == lazy["counts"]
    assert all(torch.equal(eager["state"][k], lazy["state"][k]) for k in eager["state"])
    # read right after each step, the schedule did not move at the skipped boundary (DeepSpeed's rule)
    assert eager["lrs"][INF_AT] == eager["lrs"][INF_AT - 1] and eager["lrs"][INF_AT + 1] > eager["lrs"][INF_AT]
    assert eager["engine"].overflow is False  # the last boundary applied its update
    for r in (eager, lazy):
        r["engine"].destroy()


def test_overflow_right_after_the_skipped_step_says_so():
    engine = zerocore.initialize(_model(), _config(1))
    _backward(engine, 0, inf=True)
    with pytest.warns(RuntimeWarning, match="the update was skipped"):
        engine.step()
        assert engine.overflow is True and engine.optimizer.overflow is True
    assert engine.optimizer_steps == 0 and engine.skipped_steps == 1 and engine.global_grad_norm == float("inf")
    engine.destroy()


def test_counts_are_settled_by_destroy_and_by_a_checkpoint(tmp_path):
    engine = zerocore.initialize(_model(), _config(2))
    _backward(engine, 0)
    engine.step()
    _backward(engine, 1, inf=True)
    engine.step()
    with pytest.warns(RuntimeWarning, match="the update was skipped"):
        engine.save_checkpoint(str(tmp_path), tag="t")  # reads the counts: settles
    engine.destroy()
    assert (engine.optimizer_steps, engine.skipped_steps) == (1, 1)
    fresh = zerocore.initialize(_model(), _config(2))
    fresh.load_checkpoint(str(tmp_path), tag="t")
    assert (fresh.optimizer_steps, fresh.skipped_steps) == (1, 1)
    fresh.destroy()


class LockedSchedule(torch.optim.lr_scheduler.LambdaLR):
    """A client schedule whose state cannot be copied (a lock in it)."""

    def __init__(self, optimizer):
        super().__init__(optimizer, lambda step: 1.0 / (1 + step))
        self.lock = threading.Lock()


def test_a_schedule_that_cannot_be_copied_makes_the_step_read_the_decision():
    cfg = _config(2)
    del cfg["scheduler"]
    engine = zerocore.initialize(_model(), cfg, lr_scheduler=LockedSchedule)  # a class: called with the optimizer
    assert isinstance(engine.lr_scheduler, LockedSchedule)
    with pytest.raises(TypeError):
        copy.deepcopy(engine.lr_scheduler.state_dict())
    lrs = []
    for step in range(4):
        _backward(engine, step, inf=step == 2)
        with pytest.warns(RuntimeWarning, match="the update was skipped") if step == 2 else contextlib.nullcontext():
            engine.step()
        assert engine._pending_skip is None  # read in the step (on a GPU: one event wait), none left to settle
        lrs.append(engine.get_lr()[0])
    assert engine.lr_scheduler.last_epoch == 3 and lrs[2] == lrs[1]  # not stepped at the skipped boundary
    engine.destroy()


def test_a_load_after_an_unsettled_skip_keeps_the_loaded_schedule(tmp_path):
    """Loading a checkpoint right after a skipped step (nothing read in between): the skip is settled
    first, so taking it back does not put the old schedule over the loaded one."""
    saver = train(2, read_each_step=False, inf_at=None)
    saver["engine"].save_checkpoint(str(tmp_path), tag="t")
    want_lr = saver["engine"].get_lr()[0]
    saver["engine"].destroy()
    engine = zerocore.initialize(_model(), _config(2))
    _backward(engine, 0, inf=True)
    engine.step()  # skipped on the device, not yet known on the host
    with pytest.warns(RuntimeWarning, match="the update was skipped"):
        engine.load_checkpoint(str(tmp_path), tag="t")
    assert engine.get_lr()[0] == want_lr and engine.optimizer_steps == STEPS and engine.skipped_steps == 0
    engine.destroy()


def test_a_group_value_set_before_the_skip_is_settled_is_kept():
    """Taking a skipped step back restores the schedule and the group values its step wrote, but not a
    value the user set in between (written straight into param_groups: no settling on the way)."""
    engine = zerocore.initialize(_model(), _config(2))
    _backward(engine, 0)
    engine.step()
    _backward(engine, 1, inf=True)
    engine.step()  # skipped on the device, not yet known on the host
    engine.optimizer.param_groups[0]["weight_decay"] = 0.5  # the user's own edit; lr left as the schedule set it
    with pytest.warns(RuntimeWarning, match="the update was skipped"):
        assert engine.skipped_steps == 1
    group = engine.optimizer.param_groups[0]
    assert group["weight_decay"] == 0.5 and group["lr"] == engine.lr_scheduler.get_last_lr()[0]
    assert engine.lr_scheduler.last_batch_iteration == 0  # one applied step: the skipped one's schedule step undone
    engine.destroy()

