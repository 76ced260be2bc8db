"""``deepspeed.initialize`` without an optimizer (and no ``optimizer`` section), DeepSpeed 0.19 and the face beside
each other on 2 gloo ranks (no_optimizer_script.py): stages 1 and 2 refuse with an AssertionError in both; at stages 0
and 3, fp32 and bf16, a model frozen or not: no optimizer returned, the forward's outputs equal on every rank, the
parameters partitioned outside the forward at stage 3 (each library its own layout: DeepSpeed per parameter, zerocore
per unit; both hold nothing whole), and ``step()`` refused by both."""
from __future__ import annotations

import os

import pytest

from .runner import launch

SCRIPT = os.path.join(os.path.dirname(__file__), "no_optimizer_script.py")
CASES = [{"name": f"s{stage}_{dtype}_{'frozen' if frozen else 'trainable'}", "stage": stage, "dtype": dtype,
          "frozen": frozen}
         for stage in (0, 1, 2, 3) for dtype in ("fp32", "bf16") for frozen in (False, True)]


@pytest.mark.slow  # (two torchruns of 16 engines each)
def test_no_optimizer_engine_is_deepspeeds(tmp_path):
    pytest.importorskip("deepspeed", reason="comparing with DeepSpeed needs it installed (pip install deepspeed)")
    theirs = launch("deepspeed", str(tmp_path / "ds"), CASES, script=SCRIPT)
    ours = launch("zerocore", str(tmp_path / "zc"), CASES, script=SCRIPT)
    for case in CASES:
        for rank, (want, got) in enumerate(zip(theirs[case["name"]], ours[case["name"]])):
            where = f"{case['name']} rank {rank}"
            assert got["refused"] == want["refused"], where
            if case["stage"] in (1, 2):
                assert want["refused"] == "AssertionError" and "requires an optimizer" in got["message"], where
                continue
            assert want["optimizer_returned"] is (case["dtype"] == "bf16" or case["stage"] == 3), where
            assert got["optimizer_returned"] is False and got["scheduler"] is want["scheduler"] is False, where
            assert got["out"] == want["out"], where
            whole = [32 * 48, 48, 48 * 8, 8]
            if case["stage"] == 3:
                assert all(n == 0 for n in got["numel_outside"]), where
                assert all(n < w for n, w in zip(want["numel_outside"], whole)), where  # DeepSpeed: empty views too
            else:
                assert got["numel_outside"] == want["numel_outside"] == whole, where
            assert got["step_raised"] and want["step_raised"], where
