"""DeepSpeed engine attributes and methods beside training (issue 34): tput_timer (DeepSpeed's
ThroughputTimer, driven by forward/step), allreduce_gradients, sparse_tensor_module_names, was_step_applied,
_get_optimizer_ckpt_name, the wrapped model's attributes, and no_sync misuse raising
AssertionError as DeepSpeed's does."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import zerocore


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3)
        self.id = 17  # a model attribute DeepSpeed's engine passes through

    def forward(self, x):
        return self.lin(x)


def _engine(stage=1, gas=2, micro=3):
    return zerocore.initialize(Net(), {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
                                       "zero_optimization": {"stage": stage},
                                       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})


def _micro(engine):
    engine.backward(engine(torch.randn(3, 4)).sum())
    engine.step()


def test_throughput_timer_counts_as_deepspeeds():
    t = _engine(gas=6, micro=7).tput_timer
    assert (t.batch_size, t.initialized, t.started, t.start_step) == (42, False, False, 2)
    t.stop()  # before any start(): nothing
    assert (t.initialized, t.micro_step_count) == (False, 0)
    t.start()
    t.stop()  # a micro step before start_step: counted, not timed
    assert (t.initialized, t.started, t.micro_step_count, t.global_step_count, t.start_time) == (True, False, 1, 0, 0)
    while t.micro_step_count < 6 * t.start_step:
        t.start()
        t.stop(global_step=(t.micro_step_count + 1) % 6 == 0)
    assert t.global_step_count == 2 and t.total_elapsed_time == 0
    while t.global_step_count == t.start_step:  # timed now: the window's time, reset at its boundary
        t.start()
        window, total = t.step_elapsed_time, t.total_elapsed_time
        boundary = (t.micro_step_count + 1) % 6 == 0
        t.stop(global_step=boundary)
        took = t.end_time - t.start_time
        assert t.step_elapsed_time == (0 if boundary else window + took)
        assert t.total_elapsed_time == pytest.approx(total + took)
    assert t.avg_samples_per_sec() > 0


def test_the_engine_drives_its_timer():
    engine = _engine(gas=2)
    for _ in range(8):
        _micro(engine)
    t = engine.tput_timer
    assert (t.micro_step_count, t.global_step_count) == (8, 4) and t.total_elapsed_time > 0
    assert t.avg_samples_per_sec() > 0


def test_allreduce_sparse_names_and_the_models_attributes(tmp_path):
    engine = _engine(stage=2, gas=1)
    engine.backward(engine(torch.randn(3, 4)).sum())
    engine.allreduce_gradients()  # backward() reduced already: nothing changes
    engine.step()
    assert engine.sparse_tensor_module_names == frozenset() and engine.id == 17
    path = engine.save_checkpoint(str(tmp_path), tag="t")
    assert os.path.isfile(engine._get_optimizer_ckpt_name(str(tmp_path), "t", 0))
    assert os.path.dirname(engine._get_optimizer_ckpt_name(str(tmp_path), "t")) == path


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_no_sync_misuse_is_an_assertion_error_with_deepspeeds_words(stage):
    engine = _engine(stage=stage, gas=1)
    if stage >= 2:
        with pytest.raises(AssertionError, match="no_sync context manager is incompatible"):
            with engine.no_sync():
                pass
        return
    with engine.no_sync():
        engine.backward(engine(torch.randn(3, 4)).sum())
        with pytest.raises(AssertionError, match=r"It is illegal to call Engine.step\(\) inside no_sync"):
            engine.step()
        with pytest.raises(AssertionError, match="no_sync context manager reentry is unsupported"):
            with engine.no_sync():
                pass
    with pytest.raises(RuntimeError):  # zerocore's own callers catch RuntimeError, as before
        with engine.no_sync():
            engine.step()


def test_was_step_applied_between_boundaries_and_on_a_skipped_update():
    engine = _engine(gas=2)
    assert not engine.was_step_applied()
    applied = []
    for _ in range(4):
        _micro(engine)
        applied.append(engine.was_step_applied())
    assert applied == [False, True, False, True]
    fp16 = zerocore.initialize(Net(), {"train_micro_batch_size_per_gpu": 3,
                                       "fp16": {"enabled": True, "initial_scale_power": 4},
                                       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    fp16.backward(fp16(torch.randn(3, 4).half()).sum() * float("inf"))  # Inf/NaN gradients: the update is skipped
    fp16.step()
    assert fp16.skipped_steps == 1 and not fp16.was_step_applied()
    fp16.backward(fp16(torch.randn(3, 4).half()).sum())
    fp16.step()
    assert fp16.was_step_applied()
