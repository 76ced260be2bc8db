"""Plain-torch references of every native kernel: the oracles the kernel tests compare
against, and a readable statement of what each kernel computes."""
from __future__ import annotations

import torch


def adam_step_reference(param, grad, exp_avg, exp_avg_sq, *, lr, betas, eps, weight_decay, step,
                        adamw_mode=True, grad_scale=1.0, param_out=None) -> None:
    """torch.optim.Adam(W)'s single-tensor update on fp32 state, with the gradient read in
    fp32 and multiplied by ``grad_scale``; ``param_out`` gets the RNE cast of the result."""
    beta1, beta2 = betas
    g = grad.float() * grad_scale
    if not adamw_mode and weight_decay != 0:
        g = g.add(param, alpha=weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    if adamw_mode:
        param.mul_(1 - lr * weight_decay)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
    if param_out is not None:
        param_out.copy_(param)


def pack_reference(tensors, offsets, flat) -> None:
    flat.zero_()
    for t, off in zip(tensors, offsets):
        flat[off:off + t.numel()].copy_(t.reshape(-1))


def unpack_reference(flat, tensors, offsets) -> None:
    for t, off in zip(tensors, offsets):
        t.copy_(flat[off:off + t.numel()].view_as(t))


def cast_reference(src, dst) -> None:
    dst.copy_(src)


def sum_squares_reference(t) -> tuple[float, bool]:
    d = t.double()
    return float((d * d).sum()), bool(~torch.isfinite(t).all())


def crc32c_reference(data: bytes, crc: int = 0) -> int:
    """CRC32C, bit by bit (reflected polynomial 0x82F63B78): the oracle of ops.crc32c."""
    c = crc ^ 0xFFFFFFFF
    for byte in data:
        c ^= byte
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
    return c ^ 0xFFFFFFFF
