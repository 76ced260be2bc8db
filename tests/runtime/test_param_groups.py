"""Hyper-parameter groups at stages 0-3, world 1 and 2, on the device and with CPU/NVMe offload,
against single-process torch.optim.AdamW with the same groups (weight decay on matrices only, a
different lr for the rest, a parameter in no group): the global gradient norm each step and
each tensor's training delta (relative error <= 1e-4: the ranks' summation order)."""
from __future__ import annotations

import pytest
import torch

import zerocore
from groups_helpers import GCase, check, spawn_gcases

WARMUP = {"type": "WarmupDecayLR", "params": {"total_num_steps": 6, "warmup_num_steps": 3, "warmup_max_lr": 2e-2,
                                             "warmup_type": "linear"}}

CASES_W2 = [GCase(f"s{s}", stage=s) for s in (0, 1, 2, 3)] + [
    GCase("s3_nested", model="nested", stage=3),
    GCase("s3_units", model="nested", stage=3, units=True),
    GCase("s3_gpt_frozen_sched", model="gpt", stage=3, split="decay", schedule=WARMUP),
    GCase("s1_frozen", stage=1, split="frozen"),
    GCase("s2_buckets_gas", stage=2, bucket=600, gas=2, clip=0.5),
    GCase("s2_cpu", stage=2, offload="cpu"),
    GCase("s3_units_cpu", model="nested", stage=3, offload="cpu", schedule=WARMUP, units=True),
    GCase("s3_units_frozen", model="nested", stage=3, split="frozen", units=True),
]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return spawn_gcases(CASES_W2, 2, tmp_path_factory.mktemp("groups_w2"))


@pytest.mark.parametrize("case", CASES_W2, ids=lambda c: c.name)
def test_groups_world2(world2, case):
    check(case, 2, world2[case.name])


def test_groups_world1_and_nvme(tmp_path):
    (tmp_path / "swap").mkdir()
    (tmp_path / "swap2").mkdir()
    cases = [GCase("w1_s0", stage=0), GCase("w1_s3", model="nested", stage=3),
             GCase("w1_s3_nvme", model="nested", stage=3, offload="nvme", nvme_path=str(tmp_path / "swap"),
                   units=True),
             GCase("w1_s2_nvme_sched", stage=2, offload="nvme", nvme_path=str(tmp_path / "swap2"), schedule=WARMUP)]
    res = spawn_gcases(cases, 1, tmp_path)
    for c in cases:
        check(c, 1, res[c.name])


def test_groups_are_kept_apart():
    """No flat group mixes hyper groups at stages 0-2; a stage-3 unit lays its parameters out group
    by group, so its owned range is one contiguous piece per group, covering it."""
    from dist_helpers import make_model

    for stage in (1, 3):
        model = make_model("nested", 0)
        decay = [p for p in model.parameters() if p.ndim >= 2]
        rest = [p for p in model.parameters() if p.ndim < 2]
        z = {"stage": stage, "stage3_param_persistence_threshold": 0, "stage3_unit_min_params": 100}
        with zerocore.initialize(model, {"zero_optimization": z},
                                 model_parameters=[{"params": decay}, {"params": rest, "lr": 1e-4}]) as e:
            which = {id(p): 0 for p in decay} | {id(p): 1 for p in rest}
            mixed = 0
            for g, shard in zip(e.groups, e.shards):
                hs = [which[id(p)] for p in g.params]
                assert hs == sorted(hs)
                if stage < 3:
                    assert len(set(hs)) == 1 and shard.pieces == [(0, g.hi - g.lo, hs[0])]
                assert shard.pieces[0][0] == 0 and shard.pieces[-1][1] == g.hi - g.lo
                assert all(a[1] == b[0] and a[2] < b[2] for a, b in zip(shard.pieces, shard.pieces[1:]))
                mixed += len(shard.pieces) > 1
            assert mixed == (5 if stage == 3 else 0)  # stage 3: the 5 units holding weights and biases


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


@pytest.mark.parametrize("groups, match", [
    (lambda m: [{"params": list(m.parameters())}, {"params": [m[0].weight]}], "in two groups"),
    (lambda m: [{"params": []}], "nothing to train"),
    (lambda m: [{"lr": 1.0}], "has no 'params'"),
    (lambda m: [{"params": list(m.parameters()), "momentum": 0.9}], "unknown key 'momentum'"),
    (lambda m: [{"params": list(m.parameters()), "lr": -1.0}], r"\['lr'\]"),
    (lambda m: [{"params": [torch.nn.Parameter(torch.zeros(3))]}], "not a parameter of the model"),
    (lambda m: [{"params": list(m.parameters()), "betas": (0.9,)}], r"\['betas'\]"),
])
def test_bad_groups_are_named(groups, match):
    m = _model()
    with pytest.raises((ValueError, TypeError), match=match):
        zerocore.initialize(m, {}, model_parameters=groups(m))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("client", [False, True])
def test_an_empty_group_is_kept_and_trains_nothing(stage, client, tmp_path):
    """Weight-decay grouping often leaves a group empty: it stays in param_groups (its index and lr
    where schedules expect them), as with torch and DeepSpeed, and the others train as without it."""
    def build(with_empty):
        m = _model()
        groups = [{"params": [m[0].weight, m[1].weight], "weight_decay": 0.01},
                  {"params": [m[0].bias, m[1].bias], "weight_decay": 0.0}]
        if with_empty:
            groups.insert(1, {"params": [], "weight_decay": 0.5, "lr": 0.3})
        cfg = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
               "train_micro_batch_size_per_gpu": 3}
        if client:
            return zerocore.initialize(m, cfg, optimizer=torch.optim.AdamW(groups, lr=0.1))
        return zerocore.initialize(m, {**cfg, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}},
                                   model_parameters=groups)

    a, b = build(True), build(False)
    assert len(a.optimizer.param_groups) == 3 and a.optimizer.param_groups[1]["params"] == []
    assert a.get_lr() == [0.1, 0.3, 0.1]
    x = torch.randn(3, 4)
    for e in (a, b):
        for _ in range(2):
            e.backward(e(x).pow(2).sum())
            e.step()
    want, got = b.full_state_dict(), a.full_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    a.save_checkpoint(str(tmp_path))
    c = build(True)
    c.load_checkpoint(str(tmp_path))
    assert all(torch.equal(c.full_state_dict()[k], want[k]) for k in want) and c.get_lr() == a.get_lr()


def test_optimizer_face():
    m = _model()
    e = zerocore.initialize(m, {"optimizer": {"params": {"lr": 0.1}}},
                            model_parameters=[{"params": [m[0].weight, m[1].weight]},
                                              {"params": [m[0].bias, m[1].bias], "lr": 0.01, "weight_decay": 0.0}])
    opt = e.optimizer
    assert isinstance(opt, torch.optim.Optimizer)
    assert e.get_lr() == [0.1, 0.01] and e.lr == 0.1
    opt.param_groups[1]["lr"] = 0.0  # takes effect at the next step: the biases stay where they are
    before = [m[0].bias.detach().clone(), m[0].weight.detach().clone()]
    e.backward(e(torch.randn(3, 4)).sum())
    opt.step()  # a no-op under the engine
    opt.zero_grad()
    e.step()
    assert torch.equal(m[0].bias, before[0]) and not torch.equal(m[0].weight, before[1])
    assert not opt.overflow
    e.lr = 0.5
    assert e.get_lr() == [0.5, 0.5]
    sd = opt.state_dict()
    assert [g["lr"] for g in sd["param_groups"]] == [0.5, 0.5]
    sd["param_groups"][0]["lr"] = 0.25
    opt.load_state_dict(sd)
    assert e.get_lr() == [0.25, 0.5]
    e.destroy()
