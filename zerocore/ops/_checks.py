"""Argument checks shared by the Python faces of the kernels: each raises ValueError or
TypeError naming the argument, before anything reaches native code."""
from __future__ import annotations

import math

import torch

FLOAT16S = (torch.bfloat16, torch.float16)
GRAD_DTYPES = (torch.float32,) + FLOAT16S


def check_number(name: str, value, *, low: float = 0.0, high: float | None = None, high_open=True) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"{name} must be a number, got a tensor of {value.numel()} elements")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    v = float(value)
    if math.isnan(v) or math.isinf(v):
        raise ValueError(f"{name} must be finite, got {v}")
    if v < low:
        raise ValueError(f"{name} must be >= {low}, got {v}")
    if high is not None and (v >= high if high_open else v > high):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, got {v}")
    return v


def check_betas(betas) -> tuple[float, float]:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    return (check_number("betas[0]", betas[0], high=1.0), check_number("betas[1]", betas[1], high=1.0))


def check_adam_hyper(lr, betas, eps, weight_decay) -> tuple[float, float, float, float, float]:
    """Adam's shared hyper-parameters as floats (lr, beta1, beta2, eps, weight_decay), checked
    in that order; ValueError/TypeError naming a bad one."""
    lr = check_number("lr", lr)
    beta1, beta2 = check_betas(betas)
    return lr, beta1, beta2, check_number("eps", eps), check_number("weight_decay", weight_decay)


def check_tensor(name: str, t, dtypes, numel: int | None = None, *, ref: str = "param") -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected {allowed}")
    if t.device.type != "cpu":
        raise ValueError(
            f"{name} is on {t.device}; zerocore's native kernels for {t.device.type} tensors are not "
            "built into this installation (CPU kernels only)")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous())")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements but {ref} has {numel}")
