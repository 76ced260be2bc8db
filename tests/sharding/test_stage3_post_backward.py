"""Stage 3's per-unit post-backward signal (sharding/post_backward.py) on the cases where it
fires late, twice, through a Function, or not at all: each trained at world 1 against
torch.optim.AdamW on a copy of the same model (fp32, tolerance of test_stages.py's elementwise
check), and a gathered parameter read without a copy of it in the module's ``__dict__``."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zerocore

LR, WD = 1e-2, 0.01


class Late(nn.Module):
    """``scale`` belongs to ``blocks[1]`` but is used before any block runs: its gradient arrives
    at the very end of backward, after blocks[1]'s post-backward signal (reduced again, added)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Lin(), Lin()])
        self.blocks[1].scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        x = x * self.blocks[1].scale
        return self.blocks[1](self.blocks[0](x))


class Lin(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, y=None):
        out = torch.tanh(self.lin(x))
        return out if y is None else out + y


class Twice(nn.Module):
    """One unit called twice in one forward (two signals, the unit done after the second)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = Lin(), Lin()

    def forward(self, x):
        return self.b(self.a(self.b(x)))


class LeafInput(nn.Module):
    """A parameter of the root passed as a unit's input (a leaf: the Function, not a hook) and a
    second tensor argument."""

    def __init__(self):
        super().__init__()
        self.query = nn.Parameter(torch.randn(4, 8))
        self.a, self.b = Lin(), Lin()

    def forward(self, x):
        h = self.a(x)
        return self.b(self.query, h)


class Unused(nn.Module):
    """blocks[1]'s output is computed but unused by the loss: its signal never fires."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Lin(), Lin(), Lin()])

    def forward(self, x):
        h = self.blocks[0](x)
        self.blocks[1](h)
        return self.blocks[2](h)


def _config(gas: int = 1) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas,
            "zero_optimization": {"stage": 3, "stage3_unit_classes": ["Lin"], "stage3_param_persistence_threshold": 0},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}}


@pytest.mark.parametrize("model_cls", [Late, Twice, LeafInput, Unused])
@pytest.mark.parametrize("gas", [1, 2])
def test_matches_adamw(model_cls, gas):
    torch.manual_seed(0)
    model = model_cls()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    engine = zerocore.initialize(model, _config(gas))
    try:
        for step in range(3):
            opt.zero_grad()
            for micro in range(gas):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + micro))
                (ref(x).square().mean() / gas).backward()
                engine.backward(engine(x).square().mean())
                engine.step()
            for p in ref.parameters():  # unused parameters get a zero gradient (DeepSpeed's semantics)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            norm = torch.sqrt(sum(p.grad.square().sum() for p in ref.parameters()))
            opt.step()
            assert engine.global_grad_norm == pytest.approx(norm.item(), rel=1e-5)
        got = engine.full_state_dict()
        for name, p in ref.state_dict().items():
            torch.testing.assert_close(got[name], p, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    finally:
        engine.destroy()


def test_plain_backward_through_the_engine_equals_engine_backward():
    """loss.backward() on the engine's output (runtime/torch_backward.py) with a late gradient: the same
    update as engine.backward, bit for bit."""
    torch.manual_seed(0)
    model = Late()
    a, b = zerocore.initialize(copy.deepcopy(model), _config()), zerocore.initialize(copy.deepcopy(model), _config())
    for step in range(2):
        x = torch.randn(4, 8)
        a.backward(a(x).square().mean())
        a.step()
        b(x).square().mean().backward()
        b.step()
    got, want = b.full_state_dict(), a.full_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert a.optimizer_steps == b.optimizer_steps == 2
    a.destroy()
    b.destroy()


def test_parameters_show_full_values_only_while_gathered_without_dict_shadows():
    """Reads go through the module's registered parameter (no copy in the instance ``__dict__``):
    full while its unit is gathered, empty otherwise."""
    torch.manual_seed(0)
    model = Late()
    engine = zerocore.initialize(model, _config())
    lin = model.blocks[0].lin
    assert "weight" not in lin.__dict__ and lin.weight.numel() == 0  # sharded between steps
    seen = {}
    lin.register_forward_hook(lambda m, a, o: seen.update(shadowed="weight" in m.__dict__,
                                                          shape=tuple(m.weight.shape)))
    engine.backward(engine(torch.randn(4, 8)).square().mean())
    engine.step()
    assert seen == {"shadowed": False, "shape": (8, 8)}
    assert "weight" not in lin.__dict__ and lin.weight.numel() == 0
    engine.destroy()
    assert "weight" not in lin.__dict__ and lin.weight.shape == (8, 8)
