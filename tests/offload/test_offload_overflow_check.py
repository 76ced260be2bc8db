"""An Inf/NaN gradient with CPU offload follows ``bf16.check_grad_overflow`` as without offload: on (DeepSpeed's
default) the update is skipped; off, it is applied as torch.optim applies it (the parameters take the Inf/NaN,
the norm reads inf), as DeepSpeed applies it with or without offload (its test_zero_optim_overflow.py
``test_ignore_grad_overflow``)."""
from __future__ import annotations

import math

import pytest
import torch

import zerocore


def _engine(stage: int, offload: bool, check: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    z = {"stage": stage}
    if offload:
        z["offload_optimizer"] = {"device": "cpu"}
    return zerocore.initialize(model, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": z,
                                       "bf16": {"enabled": True, "check_grad_overflow": check},
                                       "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})


def _bad_step(engine) -> None:
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    engine.backward(engine(x).float().square().mean() * float("inf"))
    engine.step()


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("offload", [False, True])
def test_inf_gradient_is_skipped_only_when_checked(stage, offload):
    for check in (True, False):
        e = _engine(stage, offload, check)
        before = [t.clone() for t in e.full_state_dict().values()]
        _bad_step(e)
        after = list(e.full_state_dict().values())
        assert not math.isfinite(float(e.get_global_grad_norm()))
        if check:
            assert e.skipped_steps == 1 and e.optimizer_steps == 0
            assert all(torch.equal(a, b) for a, b in zip(before, after))  # nothing updated
        else:
            assert e.skipped_steps == 0 and e.optimizer_steps == 1
            assert all(not torch.isfinite(a).all() for a in after)  # applied: every tensor took the NaN
        e.destroy()
