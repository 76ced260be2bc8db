"""The functional Adam/AdamW step on one flat fp32 shard: the op the engine calls."""
from __future__ import annotations

import functools
import math

import torch

from . import _loader
from .cuda import _lib as _cuda
from ._checks import (adam_multi_args, adam_tensor_args, check_adam_hyper, check_list, check_number, check_step,
                      PLAIN, steps_plain)


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
              lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0, step: int,
              adamw_mode: bool = True, grad_scale: float = 1.0, param_out: torch.Tensor | None = None) -> None:
    """One Adam (``adamw_mode=False``: L2 decay added to the gradient) or AdamW (decoupled
    decay) update, in one pass over memory.

    ``param``, ``exp_avg``, ``exp_avg_sq``: fp32, updated in place. ``grad``: fp32, bf16 or
    fp16, multiplied by ``grad_scale`` as it is read (fold loss-scale unscaling and the clip
    coefficient in here). ``step``: the step count *including* this update (1 on the first).
    ``param_out``: optional bf16/fp16 tensor of the same size that receives the updated
    parameter in the same pass.
    """
    if _cuda.routes(param):  # CUDA tensors: zerocore.ops.cuda (a clear error below if not built)
        from .cuda import kernels

        return kernels.adam_step(param, grad, exp_avg, exp_avg_sq, lr=lr, betas=betas, eps=eps,
                                 weight_decay=weight_decay, step=step, adamw_mode=adamw_mode,
                                 grad_scale=grad_scale, param_out=param_out)
    adam_tensor_args("adam_step", param, grad, exp_avg, exp_avg_sq, param_out, cuda=False)
    lr, beta1, beta2, eps, weight_decay = check_adam_hyper(lr, betas, eps, weight_decay)
    grad_scale = check_number("grad_scale", grad_scale, low=float("-inf"))
    step = check_step("step", step)
    try:
        _loader.load("adam").adam_step(param, grad, exp_avg, exp_avg_sq, param_out, lr, beta1, beta2, eps,
                                       weight_decay, step, bool(adamw_mode), grad_scale)
        return
    except (TypeError, ValueError) as exc:
        refused = exc
    # the binding refused what the fast checks let through (a shrunk storage): the full checks name it
    adam_tensor_args("adam_step", param, grad, exp_avg, exp_avg_sq, param_out, cuda=False, fast=False)
    raise refused


def adam_step_multi(params, grads, exp_avgs, exp_avg_sqs, *, steps, lr: float, betas=(0.9, 0.999),
                    eps: float = 1e-8, weight_decay: float = 0.0, adamw_mode: bool = True,
                    grad_scale: float = 1.0, param_outs=None, sources=None) -> None:
    """:func:`adam_step` over many tensors in one native call (one thread team, chunks spread
    over it). ``steps[i]`` is tensor i's step count including this update; the other
    hyper-parameters are shared. Every tensor is checked first, naming its index.

    ``sources``: None (in place), or three lists (masters, exp_avgs, exp_avg_sqs) the step reads the
    old values from, writing the new ones into ``params``/``exp_avgs``/``exp_avg_sqs`` (the same bits
    as in place; the sources are left unchanged): a step that can be dropped (the host speculation,
    offload/speculation.py). fp32 CPU tensors of the params' sizes, sharing no memory with the rest.

    ``grad_scale`` may be a one-element tensor on the tensors' device (the engine's clip coefficient,
    computed there); a non-finite value in it skips the update (nothing is written), on the CPU as
    in the CUDA kernel: the engine's deferred Inf/NaN decision (runtime/deferred_skip.py). A
    non-finite number is refused, as ever."""
    params = check_list("adam_step_multi", "params", params)
    flat_sources = None if sources is None else _sources(params, sources)
    if params and _cuda.routes(params[0]):  # CUDA tensors: zerocore.ops.cuda
        if flat_sources is not None:
            raise ValueError("adam_step_multi: sources (an out-of-place step) are for host tensors only")
        from .cuda import kernels

        return kernels.adam_step_multi(params, grads, exp_avgs, exp_avg_sqs, steps=steps, lr=lr, betas=betas,
                                       eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
                                       grad_scale=grad_scale, param_outs=param_outs)
    if isinstance(grad_scale, torch.Tensor):  # a device coefficient (the engine's clip): the CPU kernel's argument
        grad_scale = _scalar_argument(grad_scale)
        if not math.isfinite(grad_scale):
            return  # the update is skipped, as the CUDA kernel skips it (the engine's deferred Inf/NaN decision)
    native = _loader.load("adam")
    # the binding's call: in place, or reading the old master, m, v from the sources
    call = (native.adam_step_multi if flat_sources is None else
            functools.partial(native.adam_step_multi_from, flat_sources))
    refused = False
    if params and type(params[0]) in PLAIN and type(steps) in (list, tuple) and type(grad_scale) in (float, int) \
            and steps_plain(steps):
        # The usual call: the binding checks every tensor (dtypes, sizes, devices, no shared
        # memory) in C++ before writing anything, microseconds for hundreds of tensors; if it
        # refuses, the Python checks below name the problem exactly as they always did.
        try:
            hyper = check_adam_hyper(lr, betas, eps, weight_decay)
            call(params, grads, exp_avgs, exp_avg_sqs, param_outs, steps, *hyper, bool(adamw_mode), float(grad_scale))
            return
        except (TypeError, ValueError):
            refused = True  # the full checks (no fast path) name what the binding refused
    params, grads, exp_avgs, exp_avg_sqs, outs, steps = adam_multi_args(
        "adam_step_multi", params, grads, exp_avgs, exp_avg_sqs, param_outs, steps, cuda=False,
        fast=not refused)
    lr, beta1, beta2, eps, weight_decay = check_adam_hyper(lr, betas, eps, weight_decay)
    grad_scale = check_number("grad_scale", grad_scale, low=float("-inf"))
    call(params, grads, exp_avgs, exp_avg_sqs, outs, steps, lr, beta1, beta2, eps, weight_decay, bool(adamw_mode),
         grad_scale)


_SOURCE_NAMES = ("source params", "source exp_avgs", "source exp_avg_sqs")


def _sources(params: list, sources) -> list[torch.Tensor]:
    """adam_step_multi's ``sources`` (three lists) checked as lists, as the binding takes them: master,
    m, v of tensor 0, then of tensor 1, ... (each tensor is checked by the binding, naming it)."""
    op = "adam_step_multi"
    if not (isinstance(sources, (list, tuple)) and len(sources) == 3):
        raise TypeError(f"{op}: sources must be three lists (masters, exp_avgs, exp_avg_sqs), got {type(sources).__name__}")
    srcs = [check_list(op, name, lst) for name, lst in zip(_SOURCE_NAMES, sources)]
    for name, lst in zip(_SOURCE_NAMES, srcs):
        if len(lst) != len(params):
            raise ValueError(f"{op}: {name} has {len(lst)} tensors but params has {len(params)}")
    if any(t.device.type != "cpu" for lst in srcs for t in lst):
        raise ValueError(f"{op}: sources (an out-of-place step) are for host tensors only")
    return [t for triple in zip(*srcs) for t in triple]


def _scalar_argument(t: torch.Tensor) -> float:
    """A one-element ``grad_scale`` tensor on the CPU as the CPU kernel's float argument. A CUDA kernel
    reads such a tensor from device memory itself; on a CPU device this read is that kernel read, not a
    host wait for a device (``zerocore.debug.host_waits`` does not count it)."""
    if t.numel() != 1 or t.device.type != "cpu":
        raise TypeError(f"adam_step_multi: a grad_scale tensor must be one element on the tensors' device, got "
                        f"{t.numel()} on {t.device}")
    from ..debug.host_waits import device_read

    return device_read(t)
