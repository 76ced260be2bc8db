"""Device-computed (sum of squares, Inf/NaN) pairs brought to the host without waiting for the
device: each pair's kernel is launched as its gradient lands (during backward, as each gradient
is reduced), and ``fetch`` brings every pair of the boundary over in one device-to-host copy
behind one event, which the host waits on, not on the device (``zerocore.debug.host_waits`` lists
it as an event wait). One copy for all of them: a pair copied as it was launched cost five small
host operations a group (stack, cast, pinned buffer, copy, event): ~700 for a 337M model's 147
offloaded groups, in a backward whose host time was the step's limit (measured on an H100).

On a CPU device the kernels return host values already; they are kept as they are.
"""
from __future__ import annotations

import torch

from .. import ops
from .host_memory import host_empty


class LandedNorm:
    """The (sum of squares, any Inf/NaN) of one tensor, readable on the host by ``get`` (after a
    ``fetch`` of a list holding it, or alone)."""

    __slots__ = ("_value", "_device")

    def __init__(self, t: torch.Tensor):
        s, bad = ops.sum_squares(t, sync=False)
        if isinstance(s, torch.Tensor):  # launched: read by fetch
            self._value, self._device = None, (s, bad)
        else:  # a CPU device: host values
            self._value, self._device = (s, bool(bad)), None

    def get(self) -> tuple[float, bool]:
        if self._value is None:
            fetch([self])
        return self._value


def fetch(norms: list[LandedNorm]) -> None:
    """Brings the launched pairs of ``norms`` to the host: one stack of the sums and one of the flags,
    one copy into pinned memory, one event waited on."""
    pending = [n for n in norms if n._value is None]
    if not pending:
        return
    k = len(pending)
    sums = torch.stack([n._device[0] for n in pending])
    flags = torch.stack([n._device[1] for n in pending]).to(torch.float64)
    buf = host_empty(2 * k, torch.float64, True)
    buf[:k].copy_(sums, non_blocking=True)
    buf[k:].copy_(flags, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(sums.device))  # the stream the copies went on
    event.synchronize()  # the copies of this boundary's pairs, enqueued after the last of their kernels
    values = buf.tolist()
    for i, n in enumerate(pending):
        n._value, n._device = (values[i], values[k + i] > 0), None
