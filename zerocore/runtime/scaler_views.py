"""DeepSpeed's names for the engine's loss scale, on ``engine.optimizer`` (runtime/optimizer_face.py):

- ``optimizer.loss_scaler``: as DeepSpeed's ZeRO optimizers' scaler object (``DynamicLossScaler`` with fp16's
  dynamic scale: ``cur_scale``, ``cur_iter``, ``last_overflow_iter``, ``scale_factor``, ``scale_window``,
  ``min_scale``, ``delayed_shift``, ``cur_hysteresis``, ``consecutive_hysteresis``; else ``LossScaler``, a fixed
  ``cur_scale``);
- ``optimizer.loss_scale_config``: as DeepSpeed's stage-0 fp16 optimizers' ``LossScaleConfig``
  (``use_grad_scaling``, ``dynamic_loss_scale``, ``cur_iter``, ``cur_scale``, ``last_overflow_iter``,
  ``scale_factor``, ``scale_window``, ``min_loss_scale``).

Both read the engine's scaler (runtime/loss_scale.py) when asked, so they never go stale; ``cur_scale`` may be
set (a positive finite number, fp16 only), as DeepSpeed lets it be; the rest is read-only.
``raise_error_at_min_scale`` is False: at the minimum scale zerocore warns and goes on (loss_scale.py).
"""
from __future__ import annotations

import math

# DynamicLossScaler's attribute -> the engine scaler's (runtime/loss_scale.py)
_DYNAMIC = {"cur_iter": "iter", "last_overflow_iter": "last_overflow_iter", "scale_window": "window",
            "min_scale": "min_scale", "delayed_shift": "hysteresis", "cur_hysteresis": "cur_hysteresis",
            "consecutive_hysteresis": "consecutive_hysteresis"}
SCALE_FACTOR = 2.0  # the factor DeepSpeed's scalers and zerocore's halve and double by
# DynamicLossScaler's attributes that are constants here (zerocore never aborts at the minimum scale)
_CONSTANT = {"scale_factor": SCALE_FACTOR, "raise_error_at_min_scale": False}


def set_scale(scaler, value) -> None:
    """``cur_scale = value`` through a view: a positive finite number, with fp16 (bf16 and fp32 are not scaled),
    or a ValueError naming what is wrong (the scale unchanged)."""
    if not scaler.fp16:
        raise ValueError(f"zerocore: cannot set the loss scale to {value!r}: only fp16 training is loss-scaled "
                         "(bf16 and fp32 keep 1)")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"zerocore: the loss scale must be a positive finite number, got {value!r}")
    scaler.scale = float(value)


class _ScaleView:
    """What both views share: the engine's scaler behind a getter, ``cur_scale`` read and set, nothing else set."""

    __slots__ = ("_get",)
    _NAME = ""
    _SETTABLE = ("cur_scale",)

    def __init__(self, get_scaler):
        object.__setattr__(self, "_get", get_scaler)  # () -> the engine's scaler (raises once the engine is gone)

    @property
    def cur_scale(self) -> float:
        return self._get().scale

    @cur_scale.setter
    def cur_scale(self, value) -> None:
        set_scale(self._get(), value)

    def __setattr__(self, name: str, value) -> None:
        if name in self._SETTABLE:
            object.__setattr__(self, name, value)  # the property's setter
            return
        raise AttributeError(f"{self._NAME}.{name} is read-only (the engine's scaler keeps it; only cur_scale may "
                             "be set)")


class ScalerView(_ScaleView):
    """``optimizer.loss_scaler`` (see the module's docstring)."""

    __slots__ = ()
    _NAME = "optimizer.loss_scaler"
    _SETTABLE = ("cur_scale", "loss_scale")
    loss_scale = _ScaleView.cur_scale

    @property
    def dynamic(self) -> bool:
        return self._get().dynamic

    def _dynamic_only(self, name: str):
        s = self._get()
        if not s.dynamic:
            raise AttributeError(f"optimizer.loss_scaler.{name}: the loss scale is fixed (fp16.loss_scale > 0, or no "
                                 "fp16); only a dynamic scaler has it, as in DeepSpeed")
        return s

    def __getattr__(self, name: str):  # (the names not defined above)
        attr = _DYNAMIC.get(name)
        if attr is None and name not in _CONSTANT:
            raise AttributeError(f"optimizer.loss_scaler has no attribute {name!r}")
        s = self._dynamic_only(name)
        return _CONSTANT[name] if attr is None else getattr(s, attr)


class LossScaleConfigView(_ScaleView):
    """``optimizer.loss_scale_config`` (see the module's docstring)."""

    __slots__ = ("_steps",)
    _NAME = "optimizer.loss_scale_config"

    def __init__(self, get_scaler, get_steps):
        super().__init__(get_scaler)
        object.__setattr__(self, "_steps", get_steps)  # () -> the engine's boundaries so far (a fixed scale's count)

    @property
    def use_grad_scaling(self) -> bool:
        return self._get().fp16

    @property
    def dynamic_loss_scale(self) -> bool:
        return self._get().dynamic

    @property
    def cur_iter(self) -> int:
        s = self._get()
        return s.iter if s.dynamic else self._steps()

    @property
    def last_overflow_iter(self):
        s = self._get()
        return s.last_overflow_iter if s.dynamic else None

    @property
    def scale_factor(self):
        return SCALE_FACTOR if self._get().dynamic else None

    @property
    def scale_window(self):
        s = self._get()
        return s.window if s.dynamic else None

    @property
    def min_loss_scale(self):
        s = self._get()
        return s.min_scale if s.dynamic else None
