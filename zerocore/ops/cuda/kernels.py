"""The CUDA paths of zerocore.ops: multi-tensor Adam/AdamW, pack/unpack, casts and the sum of
squares, on CUDA tensors, on the current stream of their device.

zerocore.ops.adam_step / adam_step_multi / pack / unpack / cast / sum_squares and FusedAdam
send CUDA tensors here when the CUDA kernels are built; these functions can also be called
directly. Results equal the CPU kernels': Adam and casts bit for bit (same folded scalars, same
operation order, explicitly rounded float operations, the same bf16/fp16 rounding), the sum of
squares up to double-precision summation order.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .._checks import (PLAIN, adam_multi_args, adam_tensor_args, cast_args, check_adam_hyper, check_list, check_number,
                       check_step, pack_args, steps_plain, sum_squares_args, sum_squares_multi_args)
from ._lib import lib, stream_handle


def adam_step_multi(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
                    exp_avg_sqs: Sequence[torch.Tensor], *, steps, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                    weight_decay: float = 0.0, adamw_mode: bool = True, grad_scale=1.0, param_outs=None) -> None:
    """Adam/AdamW on many CUDA tensors: fp32 ``params``/``exp_avgs``/``exp_avg_sqs`` updated in
    place, ``grads`` fp32/bf16/fp16 multiplied by ``grad_scale`` as read, ``param_outs[i]``
    (optional, bf16/fp16) receiving the updated parameter in the same pass.

    ``grad_scale``: a number, or a one-element float32 CUDA tensor (e.g. a clip coefficient
    computed on the GPU) that the kernel reads itself, so no host sync is needed; a non-finite value
    there skips the update (nothing is written: the engine's deferred Inf/NaN decision). Tensors on
    several devices are stepped device by device. Tensors with the same step, dtypes and
    hyper-parameters share a launch: up to 512 of them (64 where the kernels were built with
    CUDA < 12.1 or the driver is older than 12.1)."""
    mod = lib()
    refused = False
    if type(params) is list and params and type(params[0]) in PLAIN and type(steps) in (list, tuple) \
            and steps_plain(steps) and params[0].is_cuda:
        # The usual call (one device): the binding checks every tensor, overlaps included, in C++
        # before launching; if it refuses, the Python checks below name the problem as always.
        try:
            hyper, scale_tensor = _adam_hyper("adam_step_multi", lr, betas, eps, weight_decay, adamw_mode, grad_scale)
            device = params[0].device
            mod.cuda_adam_step_multi(params, grads, exp_avgs, exp_avg_sqs, [] if param_outs is None else param_outs,
                                     steps, *hyper, _scale_on(scale_tensor, device), stream_handle(device))
            return
        except (TypeError, ValueError):
            refused = True  # the full checks (no fast path) name what the binding refused
    params, grads, exp_avgs, exp_avg_sqs, outs, steps = adam_multi_args(
        "adam_step_multi", params, grads, exp_avgs, exp_avg_sqs, param_outs, steps, cuda=True,
        fast=not refused)
    hyper, scale_tensor = _adam_hyper("adam_step_multi", lr, betas, eps, weight_decay, adamw_mode, grad_scale)
    _launch_adam(mod, params, grads, exp_avgs, exp_avg_sqs, outs or [], steps, hyper, scale_tensor)


def adam_step(param, grad, exp_avg, exp_avg_sq, *, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, step,
              adamw_mode=True, grad_scale=1.0, param_out=None) -> None:
    """zerocore.ops.adam_step for CUDA tensors (one tensor of :func:`adam_step_multi`)."""
    mod = lib()
    adam_tensor_args("adam_step", param, grad, exp_avg, exp_avg_sq, param_out, cuda=True)
    hyper, scale_tensor = _adam_hyper("adam_step", lr, betas, eps, weight_decay, adamw_mode, grad_scale)
    step = check_step("step", step)
    try:
        _launch_adam(mod, [param], [grad], [exp_avg], [exp_avg_sq], [] if param_out is None else [param_out],
                     [step], hyper, scale_tensor)
        return
    except (TypeError, ValueError) as exc:
        refused = exc
    # the binding refused what the fast checks let through: the full checks name it
    adam_tensor_args("adam_step", param, grad, exp_avg, exp_avg_sq, param_out, cuda=True, fast=False)
    raise refused


def _adam_hyper(op: str, lr, betas, eps, weight_decay, adamw_mode, grad_scale):
    """The shared scalars as the binding takes them, and the device grad_scale tensor (or None)."""
    lr, beta1, beta2, eps, weight_decay = check_adam_hyper(lr, betas, eps, weight_decay)
    scale_tensor = None
    if isinstance(grad_scale, torch.Tensor) and grad_scale.is_cuda:
        if grad_scale.dtype != torch.float32 or grad_scale.numel() != 1:
            raise TypeError(f"{op}: a grad_scale tensor must be one float32 element, got {grad_scale.numel()} "
                            f"of {str(grad_scale.dtype).replace('torch.', '')}")
        scale_tensor, grad_scale = grad_scale, 1.0
    else:
        grad_scale = check_number("grad_scale", grad_scale, low=float("-inf"))
    return (lr, beta1, beta2, eps, weight_decay, bool(adamw_mode), grad_scale), scale_tensor


def _launch_adam(mod, params, grads, exp_avgs, exp_avg_sqs, outs, steps, hyper, scale_tensor) -> None:
    """Checked lists -> one binding call per device (each on its device's current stream)."""
    if not params:
        return
    device = params[0].device
    if all(p.device == device for p in params):  # the usual case: one call
        mod.cuda_adam_step_multi(params, grads, exp_avgs, exp_avg_sqs, outs, steps, *hyper,
                                 _scale_on(scale_tensor, device), stream_handle(device))
        return
    by_device: dict[torch.device, list[int]] = {}
    for i, p in enumerate(params):
        by_device.setdefault(p.device, []).append(i)
    for dev, idx in by_device.items():
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        mod.cuda_adam_step_multi(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs),
                                 pick(outs) if outs else [], pick(steps), *hyper, _scale_on(scale_tensor, dev),
                                 stream_handle(dev))


def _scale_on(scale: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    if scale is None or scale.device == device:
        return scale
    return scale.to(device, non_blocking=True)


def _copy_bucket(op: str, tensors, offsets, flat: torch.Tensor) -> None:
    """pack or unpack (``op``) in one launch. Plain lists go to the binding without Python's
    per-tensor checks (they cost ~1-4 us a tensor: more than the GPU's copy of a 200-tensor bucket):
    it checks every tensor in C++ before launching (device, dtype, bounds, overlaps, shared memory)
    and refuses with TypeError/ValueError, after which the full checks name the problem."""
    mod = lib()
    if not (type(tensors) in (list, tuple) and type(offsets) in (list, tuple) and type(flat) in PLAIN
            and flat.is_cuda and all(type(o) is int for o in offsets)):
        tensors, offsets = pack_args(op, tensors, offsets, flat, cuda=True)
    try:
        if op == "pack":
            mod.cuda_pack(tensors, offsets, flat, stream_handle(flat.device))
        else:
            mod.cuda_unpack(flat, tensors, offsets, stream_handle(flat.device))
        return
    except (TypeError, ValueError) as exc:
        refused = exc
    pack_args(op, tensors, offsets, flat, cuda=True, fast=False)  # as zerocore.ops.pack: the full checks name it
    raise refused


def pack(tensors: Sequence[torch.Tensor], offsets: Sequence[int], flat: torch.Tensor) -> torch.Tensor:
    """zerocore.ops.pack on the GPU: one launch for the whole bucket, gaps zeroed."""
    _copy_bucket("pack", tensors, offsets, flat)
    return flat


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """zerocore.ops.unpack on the GPU: one launch for the whole bucket."""
    _copy_bucket("unpack", tensors, offsets, flat)


def cast(src: torch.Tensor, dst: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """zerocore.ops.cast on the GPU. One side may be a pinned CPU tensor: the kernel then reads
    or writes host memory directly (cast fused with the host<->device copy)."""
    mod = lib()
    src, dst, dtype = cast_args("cast", src, dst, dtype, cuda=True)
    if dst is None:
        dst = torch.empty(src.shape, dtype=dtype, device=src.device)
    device = src.device if src.is_cuda else dst.device
    mod.cuda_cast(src, dst, stream_handle(device))
    return dst


def sum_squares(t: torch.Tensor, *, sync: bool = True):
    """Sum of squares (float64) and whether any element is Inf/NaN, for a CUDA tensor.

    ``sync=False``: returns them as 0-d CUDA tensors (float64, bool) without waiting for the GPU;
    ``sync=True``: as Python (float, bool), which waits."""
    mod = lib()
    sum_squares_args("sum_squares", t, cuda=True)
    total, nonfinite = mod.cuda_sum_squares(t, stream_handle(t.device))
    if sync:
        return float(total.item()), bool(nonfinite.item())
    return total, nonfinite


def sum_squares_multi(tensors: list, *, sync: bool = True):
    """zerocore.ops.sum_squares_multi for CUDA tensors on one device: one binding call, no host
    sync with ``sync=False`` (a float64 device tensor [sum of squares, tensors holding Inf/NaN])."""
    mod = lib()
    tensors = check_list("sum_squares_multi", "tensors", tensors)
    if not tensors:
        raise ValueError("sum_squares_multi (CUDA): 'tensors' is empty, so no device holds the result "
                         "(zerocore.ops.sum_squares_multi returns (0.0, False) for it)")
    if type(tensors[0]) not in PLAIN or not tensors[0].is_cuda:
        # Not the usual call (a tensor subclass may say one thing to Python and hold another for
        # C++; a CPU list is no CUDA call): the Python checks decide before the binding sees it.
        sum_squares_multi_args("sum_squares_multi", tensors, cuda=True)
    device = tensors[0].device
    try:  # the binding checks every tensor before the first launch
        rows = mod.cuda_sum_squares_multi(tensors, stream_handle(device))
    except (TypeError, ValueError):
        sum_squares_multi_args("sum_squares_multi", tensors, cuda=True)  # names the bad one
        raise
    totals = rows.sum(0)
    if sync:
        total, nbad = totals.tolist()
        return total, nbad > 0
    return totals
