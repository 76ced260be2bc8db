"""Issue 15 item 3: a backward that raises in the middle (an autograd Function failing after
some gradients exist, caught by the user's loop) leaves the engine as it was before that
micro-batch: in-flight reductions drained, its partial gradients dropped, and the next step
equal to a run that never saw it. World 1, several groups (a small bucket / unit size) so that
some reductions happen before the failure, with and without overlap_comm.

Stages 2/3 with accumulation: a failure after a group's reduced slice was added to the earlier
micro-batches' cannot be taken apart again; the boundary step then refuses with a named error
(nothing updated) and ``engine.zero_grad()`` drops the window."""
from __future__ import annotations

import pytest
import torch

import zerocore
from failing_backward import Boom


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.fail = False

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == 1 and self.fail:  # layers 2 and 3 get gradients before this raises
                x = Boom.apply(x)
        return x


def _engine(stage, overlap, gas):
    torch.manual_seed(0)
    z = {"stage": stage, "overlap_comm": overlap, "reduce_bucket_size": 300}
    if stage == 3:
        z.update(stage3_unit_min_params=200, stage3_param_persistence_threshold=0)
    return zerocore.initialize(Net(), {"zero_optimization": z, "gradient_accumulation_steps": gas,
                                       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})


def _micro(engine, seed, fail=False):
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))
    engine.module.fail = fail
    try:
        engine.backward(engine(x).square().mean())
    finally:
        engine.module.fail = False


def _fails(engine, seed):
    with pytest.raises(RuntimeError, match="boom in backward"):
        _micro(engine, seed, fail=True)


def _equal(a, b):
    sa, sb = a.full_state_dict(), b.full_state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_failed_backward_leaves_no_trace(stage, overlap):
    engine, clean = _engine(stage, overlap, 1), _engine(stage, overlap, 1)
    try:
        for step in range(3):
            _fails(engine, 100 + step)
            for e in (engine, clean):
                _micro(e, step)
                e.step()
        assert engine.optimizer_steps == clean.optimizer_steps == 3
        assert _equal(engine, clean)
    finally:
        engine.destroy()
        clean.destroy()


@pytest.mark.parametrize("stage", [0, 1])
def test_stages_0_1_drop_a_failed_micro_batch_inside_an_accumulation_window(stage):
    engine, clean = _engine(stage, False, 2), _engine(stage, False, 2)
    try:
        for step in range(2):
            for e in (engine, clean):
                _micro(e, 10 * step)
                e.step()
            _fails(engine, 999)  # the window's second micro-batch fails, then comes again
            for e in (engine, clean):
                _micro(e, 10 * step + 1)
                e.step()
        assert _equal(engine, clean)
    finally:
        engine.destroy()
        clean.destroy()


@pytest.mark.parametrize("stage", [2, 3])
def test_stages_2_3_inside_an_accumulation_window(stage):
    """With overlap_comm the failed backward's reductions are still in flight when it raises
    (two buckets, none landed): they are drained and dropped, and training equals a clean run.
    Without overlap each group's slice is added as soon as it is reduced: the window is refused."""
    engine, clean = _engine(stage, True, 2), _engine(stage, True, 2)
    try:
        for e in (engine, clean):
            _micro(e, 0)
            e.step()
        _fails(engine, 999)
        for e in (engine, clean):
            _micro(e, 1)
            e.step()
        assert engine.optimizer_steps == 1 and _equal(engine, clean)
    finally:
        engine.destroy()
        clean.destroy()
    engine = _engine(stage, False, 2)
    try:
        _micro(engine, 0)
        engine.step()
        before = engine.full_state_dict()
        _fails(engine, 999)
        _micro(engine, 1)
        with pytest.raises(RuntimeError, match="call engine.zero_grad\\(\\) to drop the window"):
            engine.step()
        after = engine.full_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before) and engine.optimizer_steps == 0
        engine.zero_grad()
        for k in range(2):  # the next window trains normally
            _micro(engine, 2 + k)
            engine.step()
        assert engine.optimizer_steps == 1
    finally:
        engine.destroy()
