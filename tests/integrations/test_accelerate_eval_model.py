"""ZeroAccelerator.prepare(model) with no optimizer and no 'optimizer' section in the config: an engine that trains
nothing (Accelerate's DeepSpeed route builds DeepSpeed's inference engine there), one rank in this process: the
forward equals the model's, no optimizer state is held, a backward is refused naming why, and after free_memory()
the same model trains with an optimizer. Two ranks beside DDP: test_integration_accelerate.py."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("accelerate", reason="accelerate is not installed")

from zerocore.integrations.accelerate import ZeroAccelerator  # noqa: E402
from zerocore.runtime.trains_nothing import NothingToTrain  # noqa: E402

CONFIG = {"train_micro_batch_size_per_gpu": 2,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def test_prepare_without_an_optimizer_builds_an_engine_that_trains_nothing():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    plain = copy.deepcopy(model)
    acc = ZeroAccelerator(cpu=True, zerocore_config=CONFIG)
    wrapped = acc.prepare(model)
    engine = acc.zerocore_engine
    assert not engine.trains and engine.memory_report()["master"] == 0
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(wrapped(x), plain(x))
    with pytest.raises(NothingToTrain, match="ZeroAccelerator.prepare given no optimizer"):
        acc.backward(wrapped(x).sum())
    acc.free_memory()  # the engine destroyed, the model whole again, as it was
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    wrapped, opt = acc.prepare(model, opt)
    assert acc.zerocore_engine.trains
    acc.backward(wrapped(x).square().sum())
    acc.free_memory()
    assert not torch.equal(model[0].weight, plain[0].weight)  # it trained
