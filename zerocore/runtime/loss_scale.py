"""fp16 loss scaling with DeepSpeed's knobs and update rule (so a DeepSpeed config behaves the
same), except that at the minimum scale training continues with a warning instead of aborting.

bf16 and fp32 use a fixed scale of 1.
"""
from __future__ import annotations

import warnings

from ..config import FP16Config


class LossScaler:
    def __init__(self, fp16: FP16Config | None):
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
    def needed(self) -> bool:
        """Whether a backward needs its loss scaled (fp16 with a dynamic scale or a static one other than 1)."""
        return self.dynamic or self.scale != 1.0

    def update(self, overflow: bool) -> None:
        """Called once per optimizer step (skipped or not)."""
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
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
            if (self.iter - self.last_overflow_iter) % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.scale *= 2.0
        self.iter += 1
