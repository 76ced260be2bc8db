"""fp16 loss scaling with DeepSpeed's knobs and update rule (so a DeepSpeed config behaves the
same), except that at the minimum scale training continues with a warning instead of aborting.

The rule is DeepSpeed's since 0.17.1 (its loss_scaler.py and fp16 optimizers): the scale doubles at
the end of a clean step when the clean steps since the last overflow, not counting this one, are a
positive multiple of ``loss_scale_window`` (so ``window + 1`` clean steps after the start or after an
overflow, then every ``window``). Hysteresis (``fp16.hysteresis``: overflows absorbed before the scale
halves) is applied where DeepSpeed applies it, by its ZeRO optimizers (stages 1-3); its stage-0 fp16
optimizers (FP16_Optimizer, FP16_UnfusedOptimizer) halve at every overflow, and so does this scaler
built with ``hysteresis=False``. tests/deepspeed_face/test_loss_scale_against_deepspeed.py runs
DeepSpeed beside it.

bf16 and fp32 use a fixed scale of 1.
"""
from __future__ import annotations

import warnings

from ..config import FP16Config


class LossScaler:
    def __init__(self, fp16: FP16Config | None, *, hysteresis: bool = True):
        """``hysteresis``: whether ``fp16.hysteresis`` applies (DeepSpeed's ZeRO stages) or every overflow
        halves the scale (its stage 0). Not state: a checkpoint does not carry it (save.py skips ``_`` names)."""
        self._hysteresis_applies = hysteresis
        self._fp16 = fp16 is not None and fp16.enabled  # (DeepSpeed's use_grad_scaling: runtime/scaler_views.py)
        self.dynamic = fp16 is not None and fp16.enabled and fp16.loss_scale == 0
        if fp16 is None or not fp16.enabled:
            self.scale = 1.0
        elif fp16.loss_scale > 0:
            self.scale = float(fp16.loss_scale)
        else:
            self.scale = float(2 ** fp16.initial_scale_power)
            self.window = fp16.loss_scale_window
            self.min_scale = fp16.min_loss_scale
            self.hysteresis = fp16.hysteresis
            self.consecutive_hysteresis = fp16.consecutive_hysteresis
            self.cur_hysteresis = fp16.hysteresis
            self.iter = 0
            self.last_overflow_iter = -1
        self.overflows_at_min = 0

    @property
    def fp16(self) -> bool:
        """Whether fp16 is what is scaled (DeepSpeed's ``use_grad_scaling``; bf16 and fp32 keep a scale of 1)."""
        return self._fp16

    @property
    def hysteresis_applies(self) -> bool:
        """Whether overflows are absorbed by ``fp16.hysteresis`` (ZeRO stages) or each halves the scale (stage 0)."""
        return self._hysteresis_applies

    @property
    def needed(self) -> bool:
        """Whether a backward needs its loss scaled (fp16 with a dynamic scale or a static one other than 1)."""
        return self.dynamic or self.scale != 1.0

    def update(self, overflow: bool) -> None:
        """Called once per optimizer step (skipped or not)."""
        if not self.dynamic:
            return
        if overflow:
            if not self._hysteresis_applies or self.hysteresis == 1 or self.cur_hysteresis == 1:
                if self.scale <= self.min_scale:
                    self.overflows_at_min += 1
                    warnings.warn(f"zerocore: fp16 gradient overflow with the loss scale already at its minimum "
                                  f"({self.min_scale:g}); the step was skipped and training continues "
                                  f"({self.overflows_at_min} such steps so far)", RuntimeWarning, stacklevel=3)
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            stable = self.iter - self.last_overflow_iter - 1  # clean steps before this one since the overflow
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.scale *= 2.0
        self.iter += 1
