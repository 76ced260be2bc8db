"""The step's global gradient norm, overflow flag and clip coefficient, kept on the device.

Every group's sum of squares and Inf/NaN flag come from one native call over the list
(``ops.sum_squares_multi``: a pass per tensor, no Python per group); they stay on the device
(``sync=False``; a CPU device's host values are put in a tensor the same way) and are summed over
ranks there. bf16/fp32 never read them on the host: the norm and the clip coefficient are device
tensors (``device_norm``, ``clip_coef``) that the Adam kernel reads itself. fp16 reads them once per
boundary (the overflow decision, as torch's GradScaler). Offloaded gradients' norms are host values
already (accumulated as they landed): ``sum_across``.
"""
from __future__ import annotations

import torch

from .. import ops
from ..comm import Comm

_REDUCE_DTYPES = {"fp32": torch.float32, "float32": torch.float32}


def reduce_dtype(name: str | None, training: torch.dtype) -> torch.dtype | None:
    """``zero_optimization.reduce_dtype``: None = the training dtype (no conversion)."""
    if name is None:
        return None
    dt = _REDUCE_DTYPES[name]
    return None if dt == training else dt


def grad_sumsq(grads: list[torch.Tensor], comm: Comm, *, across_ranks: bool, device: torch.device) -> torch.Tensor:
    """A float64 tensor on ``device``: [sum of squares of every tensor in ``grads``, number of them
    holding Inf/NaN], summed over ranks when ``across_ranks``. Nothing is read on the host."""
    got = ops.sum_squares_multi(grads, sync=False)
    if not isinstance(got, torch.Tensor):  # CPU kernels (or no gradients): host values, as a device tensor
        got = torch.tensor([got[0], float(got[1])], dtype=torch.float64, device=device)
    if across_ranks:
        comm.all_reduce(got)
    return got


def device_norm(total: torch.Tensor, denom: float) -> torch.Tensor:
    """The global norm (a 0-d float64 device tensor) from ``grad_sumsq``'s result: the sum's square
    root divided by ``denom`` (ranks x loss scale); inf when a gradient holds Inf/NaN. The same
    float64 operations as ``math.sqrt(sumsq) / denom``: the same bits."""
    norm = total[0].sqrt() / denom
    return torch.where(total[1] > 0, torch.full_like(norm, float("inf")), norm)


def clip_coef(norm: torch.Tensor, denom: float, clip: float) -> torch.Tensor:
    """The Adam kernel's ``grad_scale`` as a one-element float32 device tensor: ``1 / denom`` times
    ``min(1, clip / (norm + 1e-6))`` when ``clip`` > 0 (torch.nn.utils.clip_grad_norm_'s coefficient),
    in float64 as the host computed it before, then rounded to float32 as the kernel's argument was."""
    coef = torch.full_like(norm, 1.0 / denom)
    if clip > 0:
        # torch.div, not clip / tensor: that is reciprocal() * clip, another rounding
        coef = coef * torch.div(torch.full_like(norm, clip), norm + 1e-6).clamp(max=1.0)
    return coef.reshape(1).to(torch.float32)


def sum_across(comm: Comm, sumsq: float, bad: bool, *, across_ranks: bool) -> tuple[float, bool]:
    """This rank's (sum of squares, any Inf/NaN) summed over the ranks in one small collective
    (when ``across_ranks``; else as it is)."""
    if across_ranks:
        sumsq, nbad = comm.sum_floats([sumsq, float(bad)])
        bad = nbad > 0
    return sumsq, bad
