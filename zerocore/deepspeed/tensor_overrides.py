"""The tensor constructors ``deepspeed.zero.Init`` overrides while it is open (DeepSpeed 0.19.8's
``tensor_overrides``), so a model built under it gets the numbers DeepSpeed's gets.

DeepSpeed replaces ``torch.tensor``, ``empty``, ``zeros``, ``ones``, ``full``, ``arange``, ``eye``,
``randn`` and ``torch.Tensor.__new__`` (``torch.Tensor(2, 3)``, ``nn.Parameter()``) for as long as its
outermost enabled ``Init`` is open. Each new tensor that comes out floating point is converted to
Init's dtype as it is created, whatever ``dtype=`` asked for (fp64 too); integer, bool and complex
tensors are left alone; a tensor made without ``device=`` (or with ``device=None``) is made on the
accelerator of this rank. So ``nn.Linear``'s ``kaiming_uniform_`` draws into a bf16 tensor, and
the values differ from an fp32 draw rounded afterwards (torch's CPU ``uniform_`` in bf16 can return
the lower bound). Other constructors (``torch.rand``, ``empty_like``, ...) are not overridden.
"""
from __future__ import annotations

import contextlib
import enum
import functools
import os

import torch


class DeepSpeedTensorOverride(enum.Enum):
    """What ``Init(tensor_overrides=...)`` overrides: the dtype, the device, or both (the default)."""

    dtype = 1
    device = 2


DEFAULT_TENSOR_OVERRIDES = (DeepSpeedTensorOverride.dtype, DeepSpeedTensorOverride.device)
OVERRIDDEN_FUNCTIONS = ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn")

_NOTHING = object()  # torch.Tensor has no __new__ of its own (it inherits TensorBase's)
_installed: list[TensorOverrides] = []  # at most one: only the outermost Init installs its overrides


def checked_overrides(tensor_overrides) -> frozenset:
    """``tensor_overrides`` as a set, each a :class:`DeepSpeedTensorOverride` (a clear error otherwise)."""
    try:
        overrides = frozenset(tensor_overrides)
    except TypeError:
        raise TypeError(f"zerocore.deepspeed.zero.Init: tensor_overrides must be a list of DeepSpeedTensorOverride "
                        f"(dtype, device), got {tensor_overrides!r}") from None
    bad = [o for o in overrides if not isinstance(o, DeepSpeedTensorOverride)]
    if bad:
        raise TypeError(f"zerocore.deepspeed.zero.Init: tensor_overrides takes DeepSpeedTensorOverride.dtype / "
                        f".device, got {bad!r}")
    return overrides


def accelerator_device() -> torch.device:
    """The device DeepSpeed's Init makes tensors on: the accelerator of this node's rank (LOCAL_RANK)."""
    from .accelerator import get_accelerator

    return torch.device(get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", "0"))))


class TensorOverrides:
    """Converts the floating tensors the overridden constructors make to ``dtype`` (None: left as
    made) and puts those made without a device on ``device`` (None: torch's default)."""

    def __init__(self, dtype: torch.dtype | None, device: torch.device | None):
        self.dtype = dtype
        self.device = device
        self._saved: dict[str, object] = {}
        self._saved_new = _NOTHING

    def _wrap(self, make):
        @functools.wraps(make)
        def made_as_init_wants(*args, **kwargs):
            if kwargs.get("device") is None and self.device is not None:
                kwargs["device"] = self.device
            t = make(*args, **kwargs)
            if self.dtype is not None and t.is_floating_point():
                # .data, not a new tensor: the caller's object stays (out=, a leaf with requires_grad)
                t.data = t.data.to(self.dtype)
            return t

        return made_as_init_wants

    def _tensor_new(self):
        empty = self._saved["empty"]

        def __new__(cls, *args, **kwargs):
            # as DeepSpeed's: a plain tensor of the given sizes (uninitialised), whatever the subclass;
            # torch.Tensor() is an empty one
            t = empty(0, device=self.device).new_empty(*(args or (0,)), **kwargs)
            return t.to(self.dtype) if self.dtype is not None and t.is_floating_point() else t

        return staticmethod(__new__)

    def install(self) -> None:
        if _installed:
            raise RuntimeError("zerocore.deepspeed.zero.Init: tensor constructors are already overridden by an "
                               "open Init; only the outermost Init overrides them")
        self._saved = {name: getattr(torch, name) for name in OVERRIDDEN_FUNCTIONS}
        self._saved_new = torch.Tensor.__dict__.get("__new__", _NOTHING)
        new = self._tensor_new()
        for name, make in self._saved.items():
            setattr(torch, name, self._wrap(make))
        torch.Tensor.__new__ = new
        _installed.append(self)

    def remove(self) -> None:
        if self not in _installed:
            return
        _installed.remove(self)
        for name, make in self._saved.items():
            setattr(torch, name, make)
        if self._saved_new is _NOTHING:
            del torch.Tensor.__new__  # back to TensorBase's, as before the context
        else:
            torch.Tensor.__new__ = self._saved_new


@contextlib.contextmanager
def lifted():
    """torch's own constructors while the block runs, if an Init has overridden them (DeepSpeed's
    ``initialize`` does the same: an engine built inside ``zero.Init`` must make its fp32 master in
    fp32); the overrides are back after it."""
    if not _installed:
        yield
        return
    overrides = _installed[0]
    overrides.remove()
    try:
        yield
    finally:
        overrides.install()
