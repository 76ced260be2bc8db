"""Buffer dtypes under bf16, side by side with DeepSpeed 0.19.8 (buffers_script.py on 2 gloo ranks):
by default an fp32 buffer stays fp32 (DeepSpeed casts only the parameters), ``data_types.buffer_dtype``
casts the buffers, ``data_types.keep_in_fp32_modules`` keeps the named ones fp32 whatever
buffer_dtype says. The buffers' dtypes after initialize are DeepSpeed's, and so is every step's loss."""
from __future__ import annotations

import os

import pytest

from .runner import launch

pytest.importorskip("deepspeed", reason="comparing with DeepSpeed needs it installed (pip install deepspeed)")

SCRIPT = os.path.join(os.path.dirname(__file__), "buffers_script.py")
# bf16-representable initial weights (the same fp32 master in both) and the same bf16 operations: the
# tolerance of the existing bf16 side-by-side with round_init (test_against_deepspeed.py)
RTOL = 1e-3

CASES = [
    {"name": "s2_default", "stage": 2, "data_types": None},
    {"name": "s2_bf16", "stage": 2, "data_types": {"buffer_dtype": "bf16"}},
    {"name": "s2_keep", "stage": 2, "data_types": {"buffer_dtype": "bfloat16", "keep_in_fp32_modules": ["inv_*"]}},
    {"name": "s3_default", "stage": 3, "data_types": None},
    {"name": "s3_keep", "stage": 3, "data_types": {"buffer_dtype": "bf16", "keep_in_fp32_modules": ["inv_freq"]}},
    # built under zero.Init: Init makes scale bf16; initialize keeps it so, or makes it fp32 when listed
    {"name": "s3_init", "stage": 3, "zero_init": True, "data_types": None},
    {"name": "s3_init_keep", "stage": 3, "zero_init": True, "data_types": {"keep_in_fp32_modules": ["scale"]}},
]
EXPECTED = {  # (rotary.inv_freq, scale) after initialize
    "s2_default": ("torch.float32", "torch.float32"), "s2_bf16": ("torch.bfloat16", "torch.bfloat16"),
    "s2_keep": ("torch.float32", "torch.bfloat16"), "s3_default": ("torch.float32", "torch.float32"),
    "s3_keep": ("torch.float32", "torch.bfloat16"), "s3_init": ("torch.float32", "torch.bfloat16"),
    "s3_init_keep": ("torch.float32", "torch.float32"),
}


def test_buffer_dtypes_and_losses_match_deepspeed(tmp_path):
    theirs = launch("deepspeed", str(tmp_path / "ds"), CASES, script=SCRIPT)
    ours = launch("zerocore", str(tmp_path / "zc"), CASES, script=SCRIPT)
    for c in CASES:
        name = c["name"]
        for rank, (a, b) in enumerate(zip(ours[name], theirs[name])):
            want = dict(zip(("rotary.inv_freq", "scale"), EXPECTED[name]))
            assert b["dtypes"] == want, f"{name} rank {rank}: DeepSpeed's buffers are not what this test expects"
            assert a["dtypes"] == b["dtypes"], f"{name} rank {rank}: buffer dtypes"
            assert a["loss"] == pytest.approx(b["loss"], rel=RTOL, abs=RTOL), f"{name} rank {rank}: losses"
    # the model tells the dtypes apart: bf16 buffers train to other losses than fp32 ones (in both)
    for runs in (ours, theirs):
        fp32, bf16 = runs["s2_default"][0]["loss"], runs["s2_bf16"][0]["loss"]
        assert max(abs(p - q) / abs(q) for p, q in zip(fp32, bf16)) > 10 * RTOL
