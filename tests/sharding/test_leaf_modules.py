"""Leaf modules (DeepSpeed's ZeRO-3 leaf modules, ``zerocore/sharding/leaf_modules.py``): stage 3 chooses no
unit inside a module flagged by ``deepspeed.utils.set_z3_leaf_modules`` or named by
``zero_optimization.leaf_module``, so a mixture-of-experts block whose experts run differently on each rank
is gathered whole.

- the unit plan: no unit inside a leaf, by size and by ``stage3_unit_classes``; a large leaf is a unit of
  its own, a leaf container (no forward of its own) stays in its parent's unit, a leaf root is the one unit;
- the config section: DeepSpeed's defaults, a string as a list of one, entries kept once, bad entries named;
- the DeepSpeed face's functions: what they flag, return and raise (DeepSpeed's signatures);
- on 2 gloo ranks, an MoE block whose rank picks its expert: without the leaf flag the ranks would gather
  different units (the divergence check names it); with it, training matches one-process AdamW on the
  same global batch, every tensor's delta and every loss.
"""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import zerocore
from stage3_ranks import LR, MICRO, WD, assert_losses, assert_states_close, batch, results, spawn
from zerocore.config import ConfigError, load_config
from zerocore.deepspeed import utils as ds_utils
from zerocore.deepspeed.runtime.zero.leaf_module_config import (DEFAULT_LEAF_MODULE_CLASSES,
                                                                DeepSpeedZeroLeafModuleConfig)
from zerocore.sharding.leaf_modules import leaf_ids
from zerocore.sharding.units import choose_unit_modules

D = 16


class Experts(nn.Module):
    """An MoE block: a router and experts, one of which runs (rank ``pick`` or the router's choice)."""

    def __init__(self, d: int = D, n: int = 2):
        super().__init__()
        self.router = nn.Linear(d, n)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x, pick: int):
        gate = torch.softmax(self.router(x), -1)[:, pick:pick + 1]
        return x + gate * torch.tanh(self.experts[pick](x))


class Net(nn.Module):
    def __init__(self, d: int = D):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.moe = Experts(d)
        self.out = nn.Linear(d, d)

    def forward(self, x, pick: int = 0):
        return self.out(self.moe(torch.tanh(self.inp(x)), pick))


def _units(model, leaves=frozenset(), classes=(), min_params=100):
    ids = {id(p) for p in model.parameters()}
    return [n for n, _ in choose_unit_modules(model, ids, classes=classes, min_params=min_params, leaves=leaves)]


# -- the unit plan ------------------------------------------------------------------------------------------
def test_no_unit_inside_a_leaf():
    model = Net()
    # (the router, 34 elements, is below stage3_unit_min_params: it stays in the root's unit)
    assert _units(model) == ["", "inp", "moe.experts.0", "moe.experts.1", "out"]
    assert _units(model, {id(model.moe)}) == ["", "inp", "moe", "out"]  # the leaf is one unit
    assert _units(model, {id(model.moe)}, min_params=10**6) == [""]  # too small: its parent's unit
    assert _units(model, {id(model)}) == [""]
    # a leaf container has no forward to gather in: its parameters stay with the unit above it
    assert _units(model, {id(model.moe.experts)}) == ["", "inp", "out"]
    # by class: the named units inside a leaf are not units
    assert _units(model, classes=["Linear"]) == ["", "inp", "moe.router", "moe.experts.0", "moe.experts.1", "out"]
    assert _units(model, {id(model.moe)}, classes=["Linear"]) == ["", "inp", "out"]
    assert _units(model, {id(model)}, classes=["Linear"]) == [""]
    with pytest.raises(ValueError, match="stage3_unit_classes: no module of class"):  # a typo is still named
        _units(model, {id(model)}, classes=["Linaer"])


def test_leaves_come_from_the_flag_and_from_the_config():
    model = Net()
    z = load_config({"zero_optimization": {"stage": 3}}).zero_optimization
    assert leaf_ids(model, z.leaf_module) == set()  # DeepSpeed's defaults name Transformers' MoE blocks only
    ds_utils.set_z3_leaf_modules(model, [Experts])
    assert leaf_ids(model, z.leaf_module) == {id(model.moe)}
    model = Net()
    qualified = f"{Experts.__module__}.{Experts.__qualname__}"
    for section, want in [({"classes": [qualified]}, [model.moe]), ({"classes": "Experts"}, [model.moe]),
                          ({"names": ["moe.experts"]}, [model.moe.experts]),
                          ({"name_suffixes": ["router", "out"]}, [model.moe.router, model.out])]:
        z = load_config({"zero_optimization": {"stage": 3, "leaf_module": section}}).zero_optimization
        assert leaf_ids(model, z.leaf_module) == {id(m) for m in want}, section
    assert not ds_utils.get_z3_leaf_modules(model)  # matching by the config leaves the model as it was


def test_optimizer_leaf_parameters_as_deepspeeds():
    """DeepSpeed's stage-3 optimizer.leaf_parameters: each leaf module with its trainable parameters (a leaf inside
    a leaf belongs to the outer one); an AttributeError below stage 3, as its stage 1-2 optimizer has none."""
    model = Net()
    ds_utils.set_z3_leaf_modules(model, [Experts, nn.ModuleList])  # moe.experts is inside moe: moe's
    model.moe.router.weight.requires_grad_(False)
    engine = zerocore.initialize(model, {"zero_optimization": {"stage": 3}})
    leaves = engine.optimizer.leaf_parameters
    assert list(leaves) == [model.moe]
    assert [id(p) for p in leaves[model.moe]] == [id(p) for p in model.moe.parameters() if p.requires_grad]
    assert len(leaves[model.moe]) == 5  # router bias, two experts' weight and bias
    engine.destroy()
    engine = zerocore.initialize(Net(), {"zero_optimization": {"stage": 2}})
    with pytest.raises(AttributeError, match="stage 3 only"):
        engine.optimizer.leaf_parameters
    engine.destroy()


def test_config_section_as_deepspeed_reads_it(caplog):
    z = load_config({"zero_optimization": {"stage": 3}}).zero_optimization
    assert z.leaf_module.classes == DEFAULT_LEAF_MODULE_CLASSES and z.leaf_module.names == []
    c = DeepSpeedZeroLeafModuleConfig(classes="my.Class", names=["a", "a", "b"], name_suffixes="tail")
    assert (c.classes, c.names, c.name_suffixes) == (["my.Class"], ["a", "b"], ["tail"])
    with pytest.raises(ConfigError, match=r"zero_optimization.leaf_module.names: .*non-empty strings"):
        load_config({"zero_optimization": {"stage": 3, "leaf_module": {"names": ["a", 3]}}})
    with pytest.raises(ConfigError, match="zero_optimization.leaf_module.colors: unknown key"):
        load_config({"zero_optimization": {"stage": 3, "leaf_module": {"colors": []}}})
    model = Net()
    z = load_config({"zero_optimization": {"stage": 3, "leaf_module": {"names": ["nowhere"]}}}).zero_optimization
    with caplog.at_level(logging.WARNING, logger="zerocore"):
        assert leaf_ids(model, z.leaf_module) == set()
    assert "no module named ['nowhere']" in caplog.text and "matched no module" in caplog.text


def test_deepspeed_face_functions():
    model = Net()
    assert ds_utils.set_z3_leaf_modules(model, [Experts]) == [model.moe]
    assert ds_utils.z3_leaf_module(model.moe) and not ds_utils.z3_leaf_module(model)
    assert ds_utils.set_z3_leaf_modules(model, ["Linear"], raise_if_not_found=False)[0] is model.inp
    assert len(ds_utils.get_z3_leaf_modules(model)) == 6
    assert len(ds_utils.unset_z3_leaf_modules(model, [nn.Linear])) == 5
    assert ds_utils.get_z3_leaf_modules(model) == [model.moe]
    with pytest.raises(ValueError, match="No modules of type"):
        ds_utils.set_z3_leaf_modules(model, [nn.Conv2d])
    assert ds_utils.set_z3_leaf_modules(model, [nn.Conv2d], raise_if_not_found=False) == []
    with pytest.raises(AssertionError, match="list of types or names"):
        ds_utils.set_z3_leaf_modules(model, [3])
    assert ds_utils.set_z3_leaf_modules_by_name(model, ["out", "gone"], raise_if_not_found=False) == ([model.out],
                                                                                                     ["gone"])
    with pytest.raises(ValueError, match="No modules named"):
        ds_utils.set_z3_leaf_modules_by_name(model, ["gone"])
    found, missing = ds_utils.set_z3_leaf_modules_by_suffix(model, ["experts.1", "zz"], flag=True,
                                                            raise_if_not_found=False)
    assert found == [model.moe.experts[1]] and missing == ["zz"]
    assert not ds_utils.z3_leaf_parameter(model.out.weight)


# -- an expert per rank, on 2 ranks ------------------------------------------------------------------------------
STEPS = 3


def _cfg(**zero):
    return {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_unit_min_params": 100,
                                  "stage3_divergence_timeout": 20, **zero},
            "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}}


def _train(engine, rank, world):
    losses = []
    for step in range(STEPS):
        x, y = batch(step, MICRO * world, D)
        lo = rank * MICRO
        loss = nn.functional.mse_loss(engine(x[lo:lo + MICRO], pick=rank), y[lo:lo + MICRO])
        engine.backward(loss)
        engine.step()
        t = loss.detach().reshape(1).double()
        torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def sc_flagged(rank, world):
    torch.manual_seed(0)
    model = Net()
    ds_utils.set_z3_leaf_modules(model, [Experts])
    engine = zerocore.initialize(model, _cfg())
    units = [u.name for u in engine.gatherer.units]
    losses = _train(engine, rank, world)
    out = {"units": units, "losses": losses, "state": engine.full_state_dict()}
    engine.destroy()
    return out


def sc_configured(rank, world):
    torch.manual_seed(0)
    model = Net()
    engine = zerocore.initialize(model, _cfg(leaf_module={"classes": ["Experts"]}))
    out = {"units": [u.name for u in engine.gatherer.units], "losses": _train(engine, rank, world),
           "state": engine.full_state_dict()}
    engine.destroy()
    return out


def sc_unflagged(rank, world):
    torch.manual_seed(0)
    engine = zerocore.initialize(Net(), _cfg())
    try:
        _train(engine, rank, world)
    except Exception as e:  # noqa: BLE001 - the test reads what it says
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn([sc_flagged, sc_configured, sc_unflagged], 2, tmp_path_factory.mktemp("leaf"), timeout=240)


def _reference(world: int = 2):
    """One process: each rank's micro-batch through its own expert, the mean loss, torch's AdamW."""
    torch.manual_seed(0)
    model = Net()
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, MICRO * world, D)
        opt.zero_grad()
        parts = [nn.functional.mse_loss(model(x[r * MICRO:(r + 1) * MICRO], pick=r), y[r * MICRO:(r + 1) * MICRO])
                 for r in range(world)]
        loss = sum(parts) / world
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict(), init


@pytest.mark.parametrize("scenario", ["flagged", "configured"])
def test_an_expert_per_rank_trains_as_one_process(ranks, scenario):
    rs = results(ranks, scenario)
    assert sorted(rs[0]["units"]) == ["", "inp", "moe", "out"]
    want_losses, want_state, init = _reference()
    for r in rs:
        assert_losses(r["losses"], want_losses)
        assert_states_close(r["state"], want_state, init)


def test_without_the_leaf_the_ranks_diverge_with_a_clear_error(ranks):
    errors = [r["error"] for r in results(ranks, "unflagged")]
    assert all(e is not None for e in errors), errors
    assert any("moe.experts" in e for e in errors), errors
