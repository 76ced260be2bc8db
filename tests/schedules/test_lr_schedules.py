"""zerocore.schedules: DeepSpeed's schedule types against DeepSpeed's own classes (lr and
momentum of every group at every step, a resume from a state dict), the config section's
validation, and the engine's stepping rules (once per accumulation boundary, not on a skipped
update, a client schedule over the face or the client optimizer, checkpointed)."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import zerocore
from zerocore import schedules
from zerocore.config import ConfigError, load_config

STEPS = 300
CASES = [
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-2, "warmup_num_steps": 50}),
    ("WarmupLR", {"warmup_num_steps": 40, "warmup_type": "linear"}),  # max lr: each group's own
    ("WarmupLR", {"warmup_min_lr": [0.0, 1e-4], "warmup_max_lr": [1e-2, 3e-3], "warmup_num_steps": 1}),
    ("WarmupDecayLR", {"total_num_steps": 250, "warmup_num_steps": 30}),
    ("WarmupDecayLR", {"total_num_steps": 200, "warmup_min_lr": 1e-4, "warmup_max_lr": 5e-3,
                       "warmup_num_steps": 20, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 250, "warmup_num_steps": 25}),
    ("WarmupCosineLR", {"total_num_steps": 120, "warmup_min_ratio": 0.1, "warmup_num_steps": 10,
                        "cos_min_ratio": 0.01, "warmup_type": "linear"}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 60}),
    ("OneCycle", {"cycle_min_lr": [1e-4, 1e-5], "cycle_max_lr": [1e-2, 1e-3], "cycle_first_step_size": 40,
                  "cycle_second_step_size": 70, "cycle_first_stair_count": 4, "decay_lr_rate": 0.01,
                  "decay_step_size": 10, "decay_mom_rate": 0.01, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}),
    ("OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 2e-3, "cycle_momentum": False, "cycle_first_step_size": 9}),
    ("LRRangeTest", {}),
    ("LRRangeTest", {"lr_range_test_min_lr": [1e-4, 2e-4], "lr_range_test_step_size": 7,
                     "lr_range_test_step_rate": 2.0, "lr_range_test_staircase": True}),
]


def _dummy():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    return torch.optim.AdamW([{"params": [a]}, {"params": [b], "lr": 3e-3}], lr=1e-2)


def _values(opt):
    return [(g["lr"], tuple(g["betas"])) for g in opt.param_groups]


@pytest.mark.parametrize("name, params", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_same_as_deepspeed(name, params):
    ds = pytest.importorskip("deepspeed.runtime.lr_schedules", reason="DeepSpeed is not installed")
    theirs_opt, ours_opt = _dummy(), _dummy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = getattr(ds, name)(theirs_opt, **params)
    ours = schedules.from_config(name, params, ours_opt)
    assert isinstance(ours, torch.optim.lr_scheduler.LRScheduler)
    assert _values(ours_opt) == _values(theirs_opt), "after construction"
    for step in range(STEPS):
        theirs.step()
        ours.step()
        assert _values(ours_opt) == _values(theirs_opt), f"step {step}"
        assert ours.get_last_lr() == theirs.get_last_lr()
    # resume: DeepSpeed's one-key state and ours both continue identically
    again = schedules.from_config(name, params, _dummy())
    again.load_state_dict(theirs.state_dict())
    resumed = schedules.from_config(name, params, _dummy())
    resumed.load_state_dict(ours.state_dict())
    for s in (again, resumed):
        assert s.last_batch_iteration == theirs.last_batch_iteration == STEPS - 1
    for _ in range(5):
        theirs.step()
        again.step()
        resumed.step()
        assert again.get_last_lr() == resumed.get_last_lr() == theirs.get_last_lr()


@pytest.mark.parametrize("section, match", [
    ({"type": "Cosine"}, "scheduler.type: got 'Cosine'"),
    ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 3}}, "scheduler.params.total_num_steps: required"),
    ({"type": "OneCycle", "params": {}}, "scheduler.params.cycle_min_lr: required"),
    ({"type": "WarmupLR", "params": {"warmup_steps": 3}}, "scheduler.params.warmup_steps: not a parameter"),
    ({"params": {"warmup_num_steps": 3}}, "scheduler.params: given without scheduler.type"),
    ({"type": "WarmupLR", "params": [1]}, "scheduler.params"),
])
def test_config_errors_are_named(section, match):
    with pytest.raises(ConfigError, match=match):
        load_config({"scheduler": section})


def test_bad_value_named_at_initialize():
    m = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="warmup_type"):
        zerocore.initialize(m, {"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}})


def test_torch_scheduler_by_name():
    m = torch.nn.Linear(3, 2)
    e = zerocore.initialize(m, {"optimizer": {"params": {"lr": 0.1}},
                                "scheduler": {"type": "StepLR", "params": {"step_size": 2, "gamma": 0.5}}})
    lrs = []
    for _ in range(5):
        e.backward(e(torch.randn(2, 3)).sum())
        e.step()
        lrs.append(e.get_lr()[0])
    assert lrs == pytest.approx([0.1, 0.05, 0.05, 0.025, 0.025])
    e.destroy()


def _train(e, steps, micro=1, dtype=torch.float32, scale=1.0):
    lrs = []
    for _ in range(steps):
        for _ in range(micro):
            e.backward(e(torch.randn(2, 3, dtype=dtype)).float().pow(2).mean() * scale)
            e.step()
        lrs.append(e.get_lr())
    return lrs


def test_stepped_once_per_boundary_not_on_overflow():
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    cfg = {"gradient_accumulation_steps": 2, "optimizer": {"params": {"lr": 0.1}}, "fp16": {"enabled": True},
           "scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_step_size": 1}}}
    e = zerocore.initialize(m, cfg)
    assert e.get_lr() == [pytest.approx(1e-3)]
    assert _train(e, 2, micro=2, dtype=torch.half) == [[pytest.approx(2e-3)], [pytest.approx(3e-3)]]
    assert not e.optimizer.overflow
    _train(e, 1, micro=2, dtype=torch.half, scale=math.inf)  # an overflow: the update and the schedule skip
    assert e.optimizer.overflow and e.skipped_steps == 1
    assert e.get_lr() == [pytest.approx(3e-3)]
    assert _train(e, 1, micro=2, dtype=torch.half) == [[pytest.approx(4e-3)]]
    e.destroy()


def test_client_schedule_wins_and_is_settable():
    m = torch.nn.Linear(3, 2)
    cfg = {"optimizer": {"params": {"lr": 0.1}}, "scheduler": {"type": "WarmupLR", "params": {}}}
    e = zerocore.initialize(m, cfg, lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s))
    assert isinstance(e.lr_scheduler, torch.optim.lr_scheduler.LambdaLR)
    assert [x[0] for x in _train(e, 3)] == pytest.approx([0.05, 0.025, 0.0125])
    e.lr_scheduler = None  # as Lightning does, to step it itself
    assert [x[0] for x in _train(e, 1)] == pytest.approx([0.0125])
    e.destroy()
    # over the client optimizer, whose param_groups the engine's face shares
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(m.parameters(), lr=0.2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    e = zerocore.initialize(m, {}, optimizer=opt, lr_scheduler=sched)
    assert e.optimizer.param_groups is opt.param_groups and e.lr_scheduler is sched
    assert [x[0] for x in _train(e, 2)] == pytest.approx([0.02, 0.002])
    e.destroy()
    other = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=1.0)
    with pytest.warns(UserWarning, match="another optimizer than the engine's: the engine steps it, but its learning"):
        e = zerocore.initialize(torch.nn.Linear(3, 2), {"optimizer": {"params": {"lr": 0.1}}},
                                lr_scheduler=torch.optim.lr_scheduler.StepLR(other, 1, gamma=0.5))
    assert [x[0] for x in _train(e, 2)] == pytest.approx([0.1, 0.1])  # accepted as DeepSpeed does: stepped,
    assert other.param_groups[0]["lr"] == 0.25  # and it is the other optimizer's lr that moves
    with pytest.raises(TypeError, match="lr_scheduler must be"):
        zerocore.initialize(torch.nn.Linear(3, 2), {}, lr_scheduler=3)


def test_checkpoint_restores_the_schedule(tmp_path):
    cfg = {"optimizer": {"params": {"lr": 0.1}},
           "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 20, "warmup_num_steps": 5}}}

    def make():
        torch.manual_seed(0)
        m = torch.nn.Linear(3, 2)
        return zerocore.initialize(m, cfg, model_parameters=[{"params": [m.weight]},
                                                              {"params": [m.bias], "lr": 0.01}])

    torch.manual_seed(1)
    e = make()
    _train(e, 4)
    e.save_checkpoint(tmp_path, tag="t")
    want = _train(e, 4)
    e.destroy()
    e = make()
    e.load_checkpoint(tmp_path, tag="t")
    assert e.lr_scheduler.last_batch_iteration == 3
    assert _train(e, 4) == want
    e.destroy()
    e = make()
    e.load_checkpoint(tmp_path, tag="t", load_lr_scheduler_states=False)
    assert e.lr_scheduler.last_batch_iteration == -1
    e.destroy()


@pytest.mark.parametrize("name", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
def test_an_unknown_warmup_type_falls_back_to_log_with_a_warning(name):
    """DeepSpeed's classes warn and warm up along the log curve; so do these (a config's scheduler
    section names the typo instead: test_bad_value_named_at_initialize)."""
    from zerocore.schedules import schedule_class

    def build(kind):
        opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        return schedule_class(name)(opt, warmup_num_steps=10, warmup_type=kind,
                                    **({"total_num_steps": 100} if name != "WarmupLR" else {}))

    with pytest.warns(UserWarning, match="warmup_type: got 'cubic'.*using 'log'"):
        odd = build("cubic")
    ref = build("log")
    assert odd.warmup_type == "log"
    for step in range(15):
        odd.step()
        ref.step()
        assert odd.get_last_lr() == ref.get_last_lr()
