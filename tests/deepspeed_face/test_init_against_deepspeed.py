"""The values of a small model (Linear, Conv2d, Embedding, LayerNorm, BatchNorm1d, tensors made with
``torch.Tensor(...)`` / ``torch.rand`` / ``torch.arange``, buffers named for fp32 as Transformers models
name them) built under DeepSpeed's own
``deepspeed.zero.Init`` and under zerocore's, with the same seed: every parameter and buffer
bit-identical, dtype included, for each way of giving Init its dtype; and what each tensor constructor
makes inside Init, after it, and after an exception left it (init_values_script.py)."""
from __future__ import annotations

import os

import pytest
import torch

from .runner import run_one_rank

pytest.importorskip("deepspeed", reason="comparing with DeepSpeed's zero.Init needs it installed "
                                         "(pip install deepspeed)")

SCRIPT = os.path.join(os.path.dirname(__file__), "init_values_script.py")
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _values(face: str, out: str) -> dict:
    return run_one_rank(SCRIPT, face, out)


def _parameter_dtype(case: str, fp16_supported: bool) -> torch.dtype:
    """DeepSpeed 0.19.8's rule (what both must show, so that two equal wrong answers fail too): a config
    without dtype= gives its training dtype; otherwise dtype= (fp16 when None) where the accelerator has
    fp16, bf16 where it has not."""
    def asked(dtype):
        return dtype if fp16_supported else BF16

    return {"cfg_bf16": BF16, "cfg_fp16": FP16, "cfg_neither": FP32, "no_cfg": asked(FP16),
            "dtype_fp32": asked(FP32), "dtype_bf16": asked(BF16), "dtype_fp16": asked(FP16),
            "cfg_bf16_dtype_fp32": asked(FP32), "nested_bf16_then_fp16": BF16, "nested_fp32_then_bf16": FP32,
            "overrides_none": FP32, "overrides_dtype": BF16, "no_fp16_dtype_fp32": BF16, "no_fp16_no_cfg": BF16}[case]


def test_model_built_under_init_is_bit_identical_to_deepspeeds(tmp_path):
    theirs = _values("deepspeed", str(tmp_path / "ds.pt"))
    ours = _values("zerocore", str(tmp_path / "zc.pt"))
    fp16_supported = theirs.pop("fp16_supported")
    assert ours.pop("fp16_supported") == fp16_supported  # zerocore's accelerator answers as DeepSpeed's
    # what each constructor makes (dtype, device, shape, class, requires_grad, leaf) inside, after, after a raise
    made, want_made = ours.pop("constructors"), theirs.pop("constructors")
    assert made == want_made
    assert want_made["inside bf16"]["empty float32"][0] == "torch.bfloat16"  # not torch's own constructors
    assert want_made["after an exception"] == want_made["after"] and want_made["after"]["empty"][0] == "torch.float32"
    assert sorted(ours) == sorted(theirs)
    for case, want in theirs.items():
        got = ours[case]
        assert sorted(got) == sorted(want), case
        for name, t in want.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), f"{case}: {name}"
        dtype = _parameter_dtype(case, fp16_supported)
        assert {t.dtype for n, t in want.items() if n.startswith("param:")} == {dtype}, case
        # buffers: those made by the overridden constructors in Init's dtype (when it overrides the dtype),
        # torch.rand's as made (fp32), integers untouched
        buffer_dtype = FP32 if case == "overrides_none" else dtype
        assert want["buffer:4.running_var"].dtype == want["buffer:5.steps"].dtype == buffer_dtype, case
        assert want["buffer:5.noise"].dtype == FP32 and want["buffer:5.count"].dtype == torch.int64, case
        # named by the model's _keep_in_fp32_modules_strict (and _keep_in_fp32_modules under fp16): fp32 again
        assert want["buffer:6.gate.e_score_correction_bias"].dtype == (FP32 if dtype != FP32 else buffer_dtype), case
        assert want["buffer:6.gate.half_only"].dtype == (FP32 if dtype == FP16 else buffer_dtype), case
        assert want["buffer:6.gate.scale"].dtype == want["param:6.gate.weight"].dtype == buffer_dtype, case
