"""What a user does to the model after ``zerocore.initialize`` (issue 15 items 5 and 6).

- ``requires_grad_`` flipped afterwards is refused at the next ``step()``, naming the parameter,
  with nothing updated; flipping it back lets training go on exactly as if nothing happened.
- ``model.zero_grad()`` inside an accumulation window is the same at every stage: ignored with a
  warning (the engine owns the gradients, as in DeepSpeed), so the result equals a loop without
  it; ``engine.destroy()`` gives ``model.zero_grad`` back."""
from __future__ import annotations

import pytest
import torch

import zerocore


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    m[2].bias.requires_grad_(False)
    return m


def _engine(stage):
    return zerocore.initialize(_model(), {"zero_optimization": {"stage": stage}, "optimizer": {
        "type": "AdamW", "params": {"lr": 1e-2}}})


def _micro(engine, seed):
    g = torch.Generator().manual_seed(seed)
    engine.backward(engine(torch.randn(4, 8, generator=g)).square().mean())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("which,flip,was", [("0.weight", False, "trainable"), ("2.bias", True, "frozen")])
def test_flipped_requires_grad_is_named_and_changes_nothing(stage, which, flip, was):
    engine, clean = _engine(stage), _engine(stage)
    try:
        _micro(engine, 0)
        engine.step()
        _micro(clean, 0)
        clean.step()
        p = dict(engine.module.named_parameters())[which]
        before = engine.full_state_dict()
        p.requires_grad_(flip)
        _micro(engine, 1)
        with pytest.raises(RuntimeError, match=rf"parameter '{which}' was {was} at zerocore.initialize"):
            engine.step()
        assert engine.optimizer_steps == 1
        after = engine.full_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        p.requires_grad_(not flip)  # put back: the same gradients would not come again, so drop them
        engine.zero_grad()
        _micro(engine, 1)
        engine.step()
        _micro(clean, 1)
        clean.step()
        got, want = engine.full_state_dict(), clean.full_state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)
    finally:
        engine.destroy()
        clean.destroy()


def _accumulate(stage, zero_grad_between, set_to_none=True):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    e = zerocore.initialize(m, {"gradient_accumulation_steps": 2, "zero_optimization": {"stage": stage},
                                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    try:
        for s in range(2):
            for k in range(2):
                _micro(e, 10 * s + k)
                e.step()
                if zero_grad_between and k == 0:
                    m.zero_grad(set_to_none=set_to_none)
        return e.full_state_dict()
    finally:
        e.destroy()
        assert "zero_grad" not in m.__dict__  # nn.Module.zero_grad is back


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_module_zero_grad_inside_accumulation_is_ignored_with_a_warning_at_every_stage(stage, set_to_none):
    want = _accumulate(stage, False)
    with pytest.warns(RuntimeWarning, match=r"model.zero_grad\(\) inside a gradient accumulation window was ignored"):
        got = _accumulate(stage, True, set_to_none)
    assert all(torch.equal(got[k], want[k]) for k in want)
