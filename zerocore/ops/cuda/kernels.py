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

from .._checks import check_adam_hyper, check_number
from ._lib import lib, stream_handle

_F16 = (torch.bfloat16, torch.float16)


def _device_of(t: torch.Tensor, what: str) -> torch.device:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cuda:
        raise ValueError(f"{what} is on {t.device}; the CUDA kernels take CUDA tensors")
    return t.device


def adam_step_multi(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
                    exp_avg_sqs: Sequence[torch.Tensor], *, steps, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                    weight_decay: float = 0.0, adamw_mode: bool = True, grad_scale=1.0, param_outs=None) -> None:
    """Adam/AdamW on many CUDA tensors: fp32 ``params``/``exp_avgs``/``exp_avg_sqs`` updated in
    place, ``grads`` fp32/bf16/fp16 multiplied by ``grad_scale`` as read, ``param_outs[i]``
    (optional, bf16/fp16) receiving the updated parameter in the same pass.

    ``grad_scale``: a number, or a one-element float32 CUDA tensor (e.g. a clip coefficient
    computed on the GPU) that the kernel reads itself, so no host sync is needed. Tensors on
    several devices are stepped device by device; each launch covers up to 64 tensors."""
    params, grads, exp_avgs, exp_avg_sqs = list(params), list(grads), list(exp_avgs), list(exp_avg_sqs)
    outs = [] if param_outs is None else list(param_outs)
    steps = list(steps)  # ints >= 1; the binding checks them and every tensor, naming the index
    lr, beta1, beta2, eps, weight_decay = check_adam_hyper(lr, betas, eps, weight_decay)
    scale_tensor = None
    if isinstance(grad_scale, torch.Tensor) and grad_scale.is_cuda:
        scale_tensor, grad_scale = grad_scale, 1.0
    else:
        grad_scale = check_number("grad_scale", grad_scale, low=float("-inf"))
    if not params:
        return
    mod = lib()
    device = _device_of(params[0], "params[0]")
    hyper = (lr, beta1, beta2, eps, weight_decay, bool(adamw_mode), grad_scale)
    try:  # the usual case, one device: no per-tensor work in Python
        mod.cuda_adam_step_multi(params, grads, exp_avgs, exp_avg_sqs, outs, steps, *hyper,
                                 _scale_on(scale_tensor, device), stream_handle(device))
        return
    except ValueError as exc:  # raised before anything is launched
        if _OTHER_DEVICE not in str(exc) or len(params) != len(grads):
            raise
    by_device: dict[torch.device, list[int]] = {}
    for i, p in enumerate(params):
        by_device.setdefault(_device_of(p, f"params[{i}]"), []).append(i)
    for dev, idx in by_device.items():  # several devices: each on its own current stream
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        mod.cuda_adam_step_multi(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs),
                                 pick(outs) if outs else [], pick(steps), *hyper, _scale_on(scale_tensor, dev),
                                 stream_handle(dev))


_OTHER_DEVICE = "but the first tensor is on"  # the binding's message for a tensor on another device


def _scale_on(scale: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    if scale is None or scale.device == device:
        return scale
    return scale.to(device, non_blocking=True)


def adam_step(param, grad, exp_avg, exp_avg_sq, *, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, step,
              adamw_mode=True, grad_scale=1.0, param_out=None) -> None:
    """zerocore.ops.adam_step for CUDA tensors (one tensor of :func:`adam_step_multi`)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1 (the count including this update), got {step!r}")
    adam_step_multi([param], [grad], [exp_avg], [exp_avg_sq], steps=[step], lr=lr, betas=betas, eps=eps,
                    weight_decay=weight_decay, adamw_mode=adamw_mode, grad_scale=grad_scale,
                    param_outs=None if param_out is None else [param_out])


def _offsets(offsets, count: int) -> list[int]:
    offs = [int(o) for o in offsets]
    if len(offs) != count:
        raise ValueError(f"got {count} tensors but {len(offs)} offsets")
    return offs


def pack(tensors: Sequence[torch.Tensor], offsets: Sequence[int], flat: torch.Tensor) -> torch.Tensor:
    """zerocore.ops.pack on the GPU: one launch for the whole bucket, gaps zeroed."""
    tensors = list(tensors)
    lib().cuda_pack(tensors, _offsets(offsets, len(tensors)), flat, stream_handle(_device_of(flat, "flat")))
    return flat


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """zerocore.ops.unpack on the GPU: one launch for the whole bucket."""
    tensors = list(tensors)
    lib().cuda_unpack(flat, tensors, _offsets(offsets, len(tensors)), stream_handle(_device_of(flat, "flat")))


def cast(src: torch.Tensor, dst: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """zerocore.ops.cast on the GPU. One side may be a pinned CPU tensor: the kernel then reads
    or writes host memory directly (cast fused with the host<->device copy)."""
    if dst is None:
        if dtype is None:
            raise ValueError("cast needs 'dst' or 'dtype'")
        dst = torch.empty(src.shape, dtype=dtype, device=src.device)
    device = src.device if src.is_cuda else _device_of(dst, "dst")
    lib().cuda_cast(src, dst, stream_handle(device))
    return dst


def sum_squares(t: torch.Tensor, *, sync: bool = True):
    """Sum of squares (float64) and whether any element is Inf/NaN, for a CUDA tensor.

    ``sync=False``: returns them as 0-d CUDA tensors (float64, bool) without waiting for the GPU;
    ``sync=True``: as Python (float, bool), which waits."""
    total, nonfinite = lib().cuda_sum_squares(t, stream_handle(_device_of(t, "tensor")))
    if sync:
        return float(total.item()), bool(nonfinite.item())
    return total, nonfinite
