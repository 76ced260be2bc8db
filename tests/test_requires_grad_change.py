"""Issue 15 item 6: ``requires_grad_`` flipped after ``zerocore.initialize`` is refused at the
next ``step()``, naming the parameter, with nothing updated; flipping it back lets training go
on exactly as if nothing had happened."""
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
