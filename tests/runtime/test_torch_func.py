"""``torch.func`` transforms through an engine (one process).

Inside a transform the engine is the caller's plain function, as DeepSpeed's engine is since 0.19
(``zerocore/_transforms.py``): ``grad``, ``grad_and_value``, ``jacrev`` and ``vmap(grad)`` of
``lambda x: engine(x)`` equal the same transforms of the untouched model at stages 0-2, with and without
gradient accumulation (no 1/accumulation steps on a transform's gradient), and leave no trace: the engine
then trains exactly as a twin that never saw a transform. At stage 3 plain ``vmap`` runs; a differentiating
transform is refused before anything is gathered, and training goes on as the twin's.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zerocore


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))).sum()


def _pair(stage: int, gas: int):
    """(engine, its twin, the untouched model): the same initial weights."""
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas, "gradient_clipping": 0.5,
           "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    torch.manual_seed(0)
    model = Net()
    plain = copy.deepcopy(model)
    engines = [zerocore.initialize(m, copy.deepcopy(cfg)) for m in (model, copy.deepcopy(plain))]
    return engines[0], engines[1], plain


def _train(engine, gas: int) -> list[float]:
    """Two optimizer steps of ``gas`` micro-batches each; the losses."""
    torch.manual_seed(1)
    losses = []
    for _ in range(2 * gas):
        loss = engine(torch.randn(3, 8))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _assert_trains_as_twin(engine, twin, gas: int) -> None:
    assert _train(engine, gas) == _train(twin, gas)
    mine, theirs = engine.full_state_dict(), twin.full_state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize("gas", [1, 4])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_transforms_through_the_engine_equal_the_plain_model(stage, gas):
    engine, twin, plain = _pair(stage, gas)
    torch.manual_seed(2)
    x = torch.randn(8)
    xs = torch.stack([x, x + 0.1, x - 0.1])
    func = torch.func
    for name, transform in [("grad", func.grad), ("jacrev", func.jacrev)]:
        assert torch.allclose(transform(lambda v: engine(v))(x), transform(plain)(x), atol=1e-6), name
    g, v = func.grad_and_value(lambda v: engine(v))(x)
    g0, v0 = func.grad_and_value(plain)(x)
    assert torch.allclose(g, g0, atol=1e-6) and torch.allclose(v, v0, atol=1e-6)
    assert torch.allclose(func.vmap(func.grad(lambda v: engine(v)))(xs), func.vmap(func.grad(plain))(xs), atol=1e-6)
    # no gradient reached the engine (stage 0 keeps .grad as views of its zeroed flat buffer)
    assert all(p.grad is None or not p.grad.any() for p in engine.module.parameters())
    _assert_trains_as_twin(engine, twin, gas)


def test_stage3_vmap_runs_and_a_differentiating_transform_is_refused():
    engine, twin, plain = _pair(3, 2)
    torch.manual_seed(2)
    x = torch.randn(8)
    xs = torch.stack([x, x + 0.1, x - 0.1])
    assert torch.allclose(torch.func.vmap(engine)(xs), torch.func.vmap(plain)(xs), atol=1e-6)
    for transform in (torch.func.grad, torch.func.jacrev, lambda f: torch.func.vmap(torch.func.grad(f))):
        with pytest.raises(RuntimeError, match="differentiating torch.func transform .* stage-3 engine's forward"):
            transform(lambda v: engine(v))(xs if transform not in (torch.func.grad, torch.func.jacrev) else x)
    assert all(p.numel() == 0 for p in engine.module.parameters())  # nothing left gathered
    _assert_trains_as_twin(engine, twin, 2)
