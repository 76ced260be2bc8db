"""fp16's dynamic loss scale, DeepSpeed's and the face's, step by step (loss_scale_script.py): the same model, the
same overflows (an Inf in the input at chosen steps), ZeRO stages 0-3, four ``fp16`` sections (hysteresis 1 and 2,
consecutive hysteresis, windows 2 and 3, the defaults), and at stages 1-3 the defaults with clipping that bites,
with CPU offload and with two micro-steps a boundary, and a fixed scale. Equal: the scale after every step, the
skipped-step counts, and the losses up to the first step whose update raised the scale (bit for bit).

After such a step the two part, by DeepSpeed: its optimizers (stage 0 and ZeRO 1-3, 0.19.8) update the scale before
they unscale the gradients (``_update_scale`` then ``unscale_and_clip_grads``, which divides by the new scale), so on
a step that doubles the scale its update reads half the gradient it was given (where clipping does not bite; said
for its stage-0 optimizers in deepspeedai/DeepSpeed pull request 8588's discussion, seen here at stages 1-3 too).
zerocore divides by the scale the backward used (tests/runtime/test_engine.py and the stage tests check each update
against torch's AdamW). With the defaults (a window of 1000) no step raises it, and the losses are equal at every
step, clipped, offloaded and accumulated too. Stage 0's losses are not compared: DeepSpeed's stage-0 fp16 optimizer
(FP16_Optimizer over FusedAdam) steps differently from its ZeRO stages on this CPU even with no overflow at all
(measured: the second step's loss 0.036323 against 0.035970, which is also zerocore's at every stage)."""
from __future__ import annotations

import os

import pytest

from .runner import run_one_rank

SCRIPT = os.path.join(os.path.dirname(__file__), "loss_scale_script.py")


def _raised_at(scales: list[float], initial: float) -> int | None:
    """The first step after which the scale went up, or None."""
    prev = initial
    for i, s in enumerate(scales):
        if s > prev:
            return i
        prev = s
    return None


@pytest.mark.slow  # (18 s: DeepSpeed and the face each build 28 engines; the rule itself: tests/runtime/test_engine.py)
def test_dynamic_loss_scale_is_deepspeeds_step_by_step(tmp_path):
    pytest.importorskip("deepspeed", reason="comparing with DeepSpeed needs it installed (pip install deepspeed)")
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().is_fp16_supported():
        pytest.skip("DeepSpeed's CPU accelerator says fp16 is not supported on this CPU")
    theirs = run_one_rank(SCRIPT, "deepspeed", str(tmp_path / "ds.pt"))
    ours = run_one_rank(SCRIPT, "zerocore", str(tmp_path / "zc.pt"))
    assert sorted(ours) == sorted(theirs) and len(theirs) == 16 + 12
    raised = 0
    for key, want in theirs.items():
        got = ours[key]
        assert got["initial"] == want["initial"], key
        assert got["scale"] == want["scale"], key
        assert got["skipped"] == want["skipped"], key
        stage, case = key
        if stage == 0:
            continue
        first = _raised_at(want["scale"], want["initial"])
        if case.startswith("defaults"):
            assert first is None
        raised += first is not None
        upto = len(want["loss"]) if first is None else first + 1  # the loss after the raising step's update differs
        assert got["loss"][:upto] == want["loss"][:upto], key
    assert raised == 9  # every case but the defaults raised the scale at stages 1-3 (the comparison above is partial)
