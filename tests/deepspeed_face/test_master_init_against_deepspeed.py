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


FP32_ACCUM = os.path.join(os.path.dirname(__file__), "fp32_accum_script.py")


def test_fp32_grad_accumulation_at_stage1_is_deepspeeds(tmp_path):
    """bf16 + ``data_types.grad_accum_dtype: "fp32"`` at stage 1 (DeepSpeed's BF16 optimizer). DeepSpeed's
    ``safe_get_full_grad`` there reports the window's fp32 sum rounded to bf16: zerocore's fp32 sum (which
    tests/runtime/test_fp32_grad_accumulation.py checks bit for bit against a hand-made fp32 sum) rounded so is it,
    in every element of both windows, while a bf16 accumulation differs from it (measured: 253 of 768 elements of
    the first weight). The fp32 masters after each step agree to 1e-5 (DeepSpeed's first update differs from torch's
    Adam on the same master and gradient by up to 2.5e-6; zerocore's by 7e-9)."""
    pytest.importorskip("deepspeed", reason="comparing with DeepSpeed needs it installed (pip install deepspeed)")
    theirs = run_one_rank(FP32_ACCUM, "deepspeed", str(tmp_path / "ds.pt"))
    ours = run_one_rank(FP32_ACCUM, "zerocore", str(tmp_path / "zc.pt"))
    assert sorted(ours) == sorted(theirs) and len(theirs) == 16
    rounded_differs = 0
    for key, want in theirs.items():
        got = ours[key]
        assert got.dtype == want.dtype == torch.float32, key
        if key.startswith("grad"):
            assert torch.equal(got.bfloat16().float(), want), key
            rounded_differs += int(not torch.equal(got, want))
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}")
    assert rounded_differs > 0  # zerocore's own value is the unrounded fp32 sum
