"""``deepspeed.runtime.zero.unwrap_model_for_generation(engine)`` (DeepSpeed's, which TRL's own follows): every
parameter gathered once for the block, the engine yielded, forwards inside it gathering nothing more (DeepSpeed
removes its hooks for that; zerocore's ``gathered`` keeps the units whole), the parameters partitioned again after,
and training on as before."""
from __future__ import annotations

import torch

import zerocore.deepspeed as deepspeed
from zerocore.deepspeed.runtime.zero import unwrap_model_for_generation
from zerocore.deepspeed.runtime.zero.stage3 import unwrap_model_for_generation as from_stage3
from zerocore.sharding.group import ShardedGroup


def test_whole_model_once_for_the_block(monkeypatch):
    assert from_stage3 is unwrap_model_for_generation
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_unit_min_params": 1}}
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    x = torch.randn(2, 8)
    with torch.no_grad():
        want = engine(x)
    gathers = []
    start = ShardedGroup.start_gather
    monkeypatch.setattr(ShardedGroup, "start_gather", lambda self, *a, **k: gathers.append(1) or start(self, *a, **k))
    with unwrap_model_for_generation(engine) as unwrapped:
        assert unwrapped is engine
        assert all(p.numel() > 0 for p in model.parameters())
        entered = len(gathers)
        with torch.no_grad():
            outs = [engine(x) for _ in range(4)]
        assert len(gathers) == entered == 3  # one per unit, on entering
    assert all(torch.equal(o, want) for o in outs)
    assert all(p.numel() == 0 for p in model.parameters())
    engine.backward(engine(x).sum())
    engine.step()
    engine.destroy()
