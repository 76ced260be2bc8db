"""An accumulation boundary's gradient coefficient: what the Adam kernel multiplies the owned
gradients by (``grad_scale``): 1 / (world x loss scale), times the clip factor; with it the step's
global gradient norm (``engine.global_grad_norm``) and the Inf/NaN decision. ``Engine.step`` calls
it once per boundary, between the reduction and the update.

No host wait here but fp16's overflow decision (``zerocore/debug/host_waits.py`` counts them):
offloaded gradients' norms are host values already (summed as they landed); bf16/fp32 keep the norm
and the clip coefficient on the device (the kernel reads the coefficient, the norm is read when
asked). A step with Inf/NaN gradients is applied (torch.optim's behaviour) unless
``bf16.check_grad_overflow`` (on by default, DeepSpeed's) asks to skip it: the kernels skip it on the
device and the host learns it at the next step or when asked (``deferred_skip.py``).
"""
from __future__ import annotations

import math

import torch

from ..profiling import label
from .deferred_skip import PendingSkip, skip_coef
from .grad_norm import clip_coef, device_norm, grad_sumsq, sum_across


def boundary_coef(eng, grads: list[torch.Tensor]):
    """``(coef, pending)`` for this boundary's update of ``grads`` (each group's owned gradient):
    ``coef`` a float or a device tensor, ``pending`` the deferred Inf/NaN decision (``PendingSkip``)
    or None. None when the update is skipped here (fp16, or a checked Inf/NaN read on the host):
    ``eng._skip()`` has run."""
    denom = eng.comm.world * eng.scaler.scale  # the reduced gradients are sums over ranks of loss-scaled ones
    across = eng.policy.partitions(eng.comm.world) > 1
    clip = eng.config.gradient_clipping
    pending = None
    with label("zerocore.grad_norm"):
        if eng.offload is not None:  # accumulated on the host as the buckets landed
            sumsq, bad = sum_across(eng._host_comm, *eng.offload.landed_sumsq(eng.groups, eng.shards),
                                    across_ranks=across)
        else:
            total = grad_sumsq(grads, eng.comm, across_ranks=across, device=eng.device)
            if eng._checks_overflow and not eng._defers_skip:
                # fp16 (or a client torch optimizer): skip the update on Inf/NaN, one read per boundary
                sumsq, nbad = total.tolist()
                bad = nbad > 0
            else:
                sumsq = bad = None
                norm = device_norm(total, denom)
                eng.global_grad_norm = norm  # a device tensor: read when asked (global_grad_norm)
                coef = clip_coef(norm, denom, clip)
                if eng._defers_skip:  # bf16.check_grad_overflow: the kernels skip, the host learns later
                    coef, flag = skip_coef(total, coef)
                    pending = PendingSkip(flag, eng.global_steps)
    if sumsq is not None:
        bad = bad or not math.isfinite(sumsq)
        if bad and eng._checks_overflow:
            eng._skip()
            return None
        # Inf/NaN without the check (bf16.check_grad_overflow: false): applied, as without offload (inf norm)
        norm = math.inf if bad else math.sqrt(sumsq) / denom
        eng.global_grad_norm = norm
        coef = 1.0 / denom
        if clip > 0:
            coef *= min(1.0, clip / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s coefficient
    return coef, pending
