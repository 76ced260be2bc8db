"""The fp32 master of bf16 training, DeepSpeed's and the face's (master_init_script.py): right after
``deepspeed.initialize`` and in the 16-bit parameters after one step, bit for bit, at ZeRO stages 1-3 (DeepSpeed
copies its master from the model converted to bf16: ``data_types.master_init: "rounded"``, the face's default).
``zerocore.initialize`` keeps the values the model was given (``"given"``, as FSDP2 keeps fp32 weights), which
for this model differ from the rounded ones: the comparison above would see the other rule."""
from __future__ import annotations

import os

import pytest
import torch

import zerocore
from zerocore.deepspeed.utils import safe_get_full_fp32_param

from .runner import run_one_rank

SCRIPT = os.path.join(os.path.dirname(__file__), "master_init_script.py")


def _values(face: str, out: str) -> dict:
    return run_one_rank(SCRIPT, face, out)


def test_bf16_master_and_first_step_are_deepspeeds(tmp_path):
    pytest.importorskip("deepspeed", reason="comparing with DeepSpeed needs it installed (pip install deepspeed)")
    theirs = _values("deepspeed", str(tmp_path / "ds.pt"))
    ours = _values("zerocore", str(tmp_path / "zc.pt"))
    assert sorted(ours) == sorted(theirs) == [1, 2, 3]
    for stage, want in theirs.items():
        assert sorted(ours[stage]) == sorted(want)
        for name, value in want.items():
            got = ours[stage][name]
            assert got.dtype == value.dtype and torch.equal(got, value), f"stage {stage} {name}"


def test_zerocore_initialize_keeps_the_given_values():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 16)
    given = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = zerocore.initialize(model, {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}})
    rounded = 0
    for name, p in model.named_parameters():
        master = safe_get_full_fp32_param(p)
        assert torch.equal(master, given[name]), name
        rounded += not torch.equal(master, given[name].to(torch.bfloat16).float())
    assert rounded == 2  # both tensors hold values that bf16 rounds: the two rules differ here
    engine.destroy()
    with pytest.raises(zerocore.config.ConfigError, match="master_init"):
        zerocore.initialize(torch.nn.Linear(2, 2), {"data_types": {"master_init": "exact"}})
