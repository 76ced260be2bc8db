"""``copy.deepcopy`` of a model a stage-3 engine holds: refused while a parameter is partitioned (the copy would hold
empty tensors), naming it and the way out; under ``zerocore.gathered`` a plain copy of the model with its values, of
its own classes and tied to no engine (the engine's gatherer and buffers are not copied); whole parameters (stage 2,
persistent ones) copy as before. One rank, in this process."""
from __future__ import annotations

import copy

import pytest
import torch

import zerocore
from dist_helpers import gc_tensor_bytes

D = 64


def _config(stage: int = 3, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                  "stage3_unit_min_params": 100, **zero}}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(D, D) for _ in range(4)])


def _trained(stage: int = 3, **zero):
    model = _model()
    engine = zerocore.initialize(model, _config(stage, **zero))
    x = torch.randn(3, D)
    engine.backward(engine(x).square().sum())
    engine.step()
    return engine, model, x


def test_a_partitioned_model_is_refused_naming_the_parameter():
    engine, model, _ = _trained()
    with pytest.raises(RuntimeError, match=r"deepcopy of stage-3 parameter '0.weight' while it is partitioned .*"
                                           r"zerocore.gathered\(list\(module.parameters\(\)\)\)"):
        copy.deepcopy(model)
    engine.destroy()


def test_gathered_the_copy_is_a_plain_model_with_the_values():
    engine, model, x = _trained()
    whole = sum(p.numel() * p.element_size() for p in _model().parameters())
    before = gc_tensor_bytes()
    with zerocore.gathered(list(model.parameters())):
        twin = copy.deepcopy(model)
    # the model's values, no more: the engine's gatherer, groups and buffers stayed the engine's
    assert gc_tensor_bytes() - before <= whole + 4096
    assert all(type(m) in (torch.nn.Sequential, torch.nn.Linear) and "_zc_gatherer" not in m.__dict__
               for m in twin.modules())
    assert all(type(p) is torch.nn.Parameter and not hasattr(p, "ds_id") for p in twin.parameters())
    with torch.no_grad():
        assert torch.equal(twin(x), engine(x))
        twin[0].weight.add_(1.0)  # its own tensors: the engine's model does not move
        assert torch.equal(engine(x), engine(x)) and not torch.equal(twin(x), engine(x))
    state = engine.full_state_dict()
    engine.destroy()
    assert torch.equal(state["0.weight"] + 1.0, twin[0].weight)


def test_whole_parameters_copy_as_before():
    for stage, zero in ((2, {}), (3, {"stage3_param_persistence_threshold": 10 ** 6})):  # persistent: whole
        engine, model, x = _trained(stage, **zero)
        twin = copy.deepcopy(model)
        with torch.no_grad():
            assert torch.equal(twin(x), engine(x)), stage
        engine.destroy()


def test_a_model_built_under_zerocore_init_is_refused():
    with zerocore.init(_config()):
        model = _model()
    with pytest.raises(RuntimeError, match=r"deepcopy of stage-3 parameter \(a Linear parameter of shape \(64, 64\), "
                                           "built under zerocore.init\\) while it is partitioned"):
        copy.deepcopy(model)
