"""FusedAdam: a drop-in ``torch.optim.Optimizer`` whose step runs the native multi-tensor
Adam/AdamW kernel: every parameter of a group in one native call.

State layout and param-group keys are exactly torch.optim.AdamW's (``step``, ``exp_avg``,
``exp_avg_sq``; ``decoupled_weight_decay`` and friends), so a state dict saved by either loads
into the other.
"""
from __future__ import annotations

import torch

from . import _loader
from .cuda import _lib as _cuda
from ._checks import check_betas, check_number

# torch.optim.Adam(W)'s group keys that we carry for state-dict compatibility, with the only
# values we support.
_TORCH_FIXED = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                "differentiable": False, "fused": None}


class FusedAdam(torch.optim.Optimizer):
    """Adam (``adamw_mode=False``: L2 decay added to the gradient, like torch.optim.Adam) or
    AdamW (``adamw_mode=True``, decoupled decay, like torch.optim.AdamW).

    ``weight_decay`` defaults to the matching torch class's default: 0.01 for AdamW, 0 for Adam.
    Parameters must be fp32, on the CPU or (when zerocore's CUDA kernels are built) on CUDA
    devices; a param group may set its own ``adamw_mode``.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float | None = None, adamw_mode: bool = True, amsgrad: bool = False,
                 *, maximize: bool = False):
        if weight_decay is None:
            weight_decay = 0.01 if adamw_mode else 0.0
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=None, capturable=False, differentiable=False,
                        fused=None, decoupled_weight_decay=bool(adamw_mode))
        _validate_group(defaults, where="FusedAdam")
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        if "adamw_mode" in param_group:
            param_group["decoupled_weight_decay"] = bool(param_group.pop("adamw_mode"))
        super().add_param_group(param_group)
        _validate_group(self.param_groups[-1], where=f"param_groups[{len(self.param_groups) - 1}]")

    def __setstate__(self, state: dict) -> None:
        # Called by load_state_dict: a group saved by torch.optim.Adam/AdamW or by an older
        # zerocore may lack keys; give them the values we support.
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in _TORCH_FIXED.items():
                group.setdefault(key, value)
            group.setdefault("decoupled_weight_decay", True)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        lib = _loader.load("adam")
        # Check everything before touching any state, so a bad group or parameter leaves the
        # optimizer and the model exactly as they were.
        work = []
        for gi, group in enumerate(self.param_groups):
            _validate_group(group, where=f"param_groups[{gi}]")
            with_grad = [p for p in group["params"] if p.grad is not None]
            for pi, p in enumerate(group["params"]):
                if p.grad is not None:
                    _check_param(p, gi, pi)
            work.append((group, with_grad))
        for group, with_grad in work:
            if with_grad:
                self._step_group(lib, group, with_grad)
        return loss


    def _step_group(self, lib, group: dict, with_grad: list) -> None:
        params, grads, exp_avgs, exp_avg_sqs, writeback = [], [], [], [], []
        for p in with_grad:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            grads.append(p.grad if p.grad.is_contiguous() else p.grad.contiguous())
            if p.is_contiguous():
                params.append(p)
            else:  # the kernel walks flat memory: step a contiguous copy, then copy back
                flat = p.contiguous()
                params.append(flat)
                writeback.append((p, flat))
        # Step counters stay per-parameter float tensors (torch's layout); bump and read them
        # in two batched ops rather than one .item() per parameter.
        counters = [self.state[p]["step"] for p in with_grad]
        torch._foreach_add_(counters, 1.0)
        steps = [int(s) for s in torch.stack(counters).tolist()]
        beta1, beta2 = group["betas"]
        hyper = (float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
                 bool(group["decoupled_weight_decay"]), 1.0)
        on_gpu = [i for i, p in enumerate(params) if p.is_cuda]  # CUDA params: the CUDA kernel
        if on_gpu:
            from .cuda import kernels

            pick = lambda xs, idx: [xs[i] for i in idx]  # noqa: E731
            kernels.adam_step_multi(pick(params, on_gpu), pick(grads, on_gpu), pick(exp_avgs, on_gpu),
                                    pick(exp_avg_sqs, on_gpu), steps=pick(steps, on_gpu), lr=hyper[0],
                                    betas=hyper[1:3], eps=hyper[3], weight_decay=hyper[4], adamw_mode=hyper[5])
            rest = [i for i, p in enumerate(params) if not p.is_cuda]
            params, grads, exp_avgs, exp_avg_sqs, steps = (pick(xs, rest) for xs in
                                                           (params, grads, exp_avgs, exp_avg_sqs, steps))
        if params:
            lib.adam_step_multi(params, grads, exp_avgs, exp_avg_sqs, None, steps, *hyper)
        for p, flat in writeback:
            p.copy_(flat)


def _validate_group(group: dict, where: str) -> None:
    check_number(f"{where}: lr", group["lr"])
    check_betas(group["betas"])
    check_number(f"{where}: eps", group["eps"])
    check_number(f"{where}: weight_decay", group["weight_decay"])
    for key in ("amsgrad", "maximize", "capturable", "differentiable"):
        if group.get(key):
            raise ValueError(f"{where}: {key}=True is not supported by FusedAdam; use torch.optim.AdamW for it")


def _check_param(p: torch.Tensor, gi: int, pi: int) -> None:
    where = f"FusedAdam: param_groups[{gi}]['params'][{pi}]"
    if p.device.type != "cpu" and not (p.is_cuda and _cuda.available()):
        raise ValueError(f"{where} is on {p.device}; this zerocore build has CPU kernels only "
                         "(the CUDA multi-tensor Adam is not built into it)")
    if p.dtype != torch.float32:
        raise TypeError(f"{where} has dtype {p.dtype}; FusedAdam steps float32 parameters (keep an fp32 "
                        "master copy, as the zerocore engine does, for 16-bit models)")
    if p.grad.is_sparse:
        raise TypeError(f"{where} has a sparse gradient; FusedAdam needs dense gradients")
    if p.grad.dtype != p.dtype:
        raise TypeError(f"{where}: gradient dtype {p.grad.dtype} differs from the parameter's {p.dtype}")
