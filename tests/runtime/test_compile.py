"""``torch.compile`` with zerocore at every stage: the module compiled before ``initialize``, after it
(``engine.module.compile()``, the order FSDP2 documents) or through ``engine.compile()`` (what
Accelerate and Transformers call), with and without CPU offload, trains as the eager zerocore run of
the same model and config does (losses and parameters after a few steps). World 1.

Each case compiles a small model (seconds to tens of seconds on a loaded CPU): the fast set keeps
stage 3 compiled after ``initialize``, the case that once failed; the rest are marked slow.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerocore

STEPS = 3


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + self.lin(self.norm(x))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), Block(16), Block(16), nn.Linear(16, 4))


def config(stage: int, offload: bool) -> dict:
    z = {"stage": stage}
    if stage == 3:
        z.update(stage3_unit_classes=["Block"], stage3_param_persistence_threshold=0)
    if offload:
        z["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            z["offload_param"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 4, "zero_optimization": z,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def train(stage: int, offload: bool, when: str) -> tuple[list[float], list[torch.Tensor]]:
    """Losses of STEPS steps and the final full parameters; ``when``: eager, before, after or engine."""
    torch._dynamo.reset()
    model = make_model()
    if when == "before":
        model.compile()
    engine = zerocore.initialize(model, config(stage, offload))
    if when == "after":
        engine.module.compile()
    elif when == "engine":
        engine.compile()
        assert engine.is_compiled
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    losses = []
    for _ in range(STEPS):  # one batch again and again: the loss must fall
        loss = (engine(x) - y).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = [t.clone() for t in engine.full_state_dict().values()]
    engine.destroy()
    return losses, params


_EAGER: dict = {}


def check_like_eager(stage: int, offload: bool, when: str) -> None:
    key = (stage, offload)
    if key not in _EAGER:
        _EAGER[key] = train(stage, offload, "eager")
    want_losses, want_params = _EAGER[key]
    losses, params = train(stage, offload, when)
    # compiled kernels may round differently (fused layer norm): close, not bitwise
    assert losses == pytest.approx(want_losses, rel=1e-4, abs=1e-6)
    assert losses[-1] < losses[0]  # it trains
    for got, want in zip(params, want_params):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_stage3_compiled_after_initialize():
    check_like_eager(3, False, "after")


CASES = [(s, o, w) for s in (0, 1, 2, 3) for o in (False, True) for w in ("before", "after", "engine")
         if not (s == 0 and o) and (s, o, w) != (3, False, "after")]


@pytest.mark.slow
@pytest.mark.parametrize("stage,offload,when", CASES,
                         ids=[f"stage{s}-{'offload' if o else 'device'}-{w}" for s, o, w in CASES])
def test_compiled_trains_as_eager(stage, offload, when):
    check_like_eager(stage, offload, when)
