"""Device-computed (sum of squares, Inf/NaN) pairs brought to the host without waiting for the
device: the kernel's results are copied into host memory behind an event as soon as they are
launched (during backward, as each gradient is reduced), and the host step that needs them waits
on that event, not on the device (``zerocore.debug.host_waits`` lists it as an event wait).

On a CPU device the kernels return host values already; they are kept as they are.
"""
from __future__ import annotations

import torch

from .. import ops
from .host_memory import host_empty


class LandedNorm:
    """The (sum of squares, any Inf/NaN) of one device tensor, readable on the host by ``get``."""

    __slots__ = ("_value", "_buf", "_event")

    def __init__(self, t: torch.Tensor, pin: bool):
        s, bad = ops.sum_squares(t, sync=False)
        self._event = None
        if not isinstance(s, torch.Tensor):  # a CPU device: host values
            self._value = (s, bool(bad))
            return
        self._buf = host_empty(2, torch.float64, pin)
        self._buf.copy_(torch.stack([s, bad.to(torch.float64)]), non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def get(self) -> tuple[float, bool]:
        if self._event is not None:
            self._event.synchronize()  # the copy of this pair, recorded when it was launched
            self._event = None
            s, bad = self._buf.tolist()
            self._value = (s, bad > 0)
        return self._value
