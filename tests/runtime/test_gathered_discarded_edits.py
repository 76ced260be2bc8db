"""``zerocore.gathered`` without ``modifier_rank`` drops an in-place edit at stage 3 (the block is for reading):
the drop is named in a RuntimeWarning, or raised as a RuntimeError with ``zero_optimization.enable_sanity_checks``
(DeepSpeed's rule there). At stages 1-2 the parameters are the live ones and an edit stays: nothing is said. One
rank; two ranks and ``zerocore.init``'s parameters: test_gathered.py, test_partition_init.py."""
from __future__ import annotations

import warnings

import pytest
import torch

import zerocore


def _engine(stage: int, **zero):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return zerocore.initialize(model, {"train_micro_batch_size_per_gpu": 2,
                                       "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                                             **zero}})


def _edit(engine, modifier_rank=None):
    w = engine.module[0].weight
    with zerocore.gathered([w, engine.module[2].weight], modifier_rank=modifier_rank):
        with torch.no_grad():
            w.add_(1.0)
    return engine.full_state_dict()["0.weight"]


def test_stage3_discarded_edit_warns_and_sanity_checks_raise():
    e = _engine(3)
    before = e.full_state_dict()["0.weight"]
    with pytest.warns(RuntimeWarning, match=r"in-place modification of 0\.weight inside a block without modifier_rank"):
        after = _edit(e)
    assert torch.equal(after, before)  # discarded
    e.destroy()
    e = _engine(3, enable_sanity_checks=True)
    with pytest.raises(RuntimeError, match=r"0\.weight .*enable_sanity_checks"):
        _edit(e)
    assert torch.equal(e.full_state_dict()["0.weight"], before)  # still discarded, the engine usable
    e.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_kept_edits_and_reading_say_nothing(stage):
    e = _engine(stage, enable_sanity_checks=True)
    before = e.full_state_dict()["0.weight"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kept = _edit(e, modifier_rank=0)  # kept at every stage
        assert torch.equal(kept, before + 1)
        if stage < 3:  # the live parameters: the edit stays, nothing to report
            assert torch.equal(_edit(e), (before + 1) + 1)
        with zerocore.gathered(list(e.module.parameters())):
            pass
    e.destroy()
