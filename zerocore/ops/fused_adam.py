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
        self._plans.clear()
        _validate_group(self.param_groups[-1], where=f"param_groups[{len(self.param_groups) - 1}]")

    def __setstate__(self, state: dict) -> None:
        # Called by load_state_dict: a group saved by torch.optim.Adam/AdamW or by an older
        # zerocore may lack keys; give them the values we support.
        super().__setstate__(state)
        self.__dict__["_zc_plans"] = {}  # the state was replaced: plans are rebuilt at the next step
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
        # Check everything before touching any state, so a bad group or parameter leaves the
        # optimizer and the model exactly as they were. A group stepped before with the same
        # parameters (and gradients present on the same ones) reuses its checked plan: one native
        # call, whose binding checks every gradient before anything is written. With several
        # groups the gradients are checked here first (a few attribute reads each), so that a bad
        # one in a later group cannot leave an earlier group stepped.
        work = []
        several = len(self.param_groups) > 1
        for gi, group in enumerate(self.param_groups):
            _validate_group(group, where=f"param_groups[{gi}]")
            params = group["params"]
            grads = [p.grad for p in params]
            plan = self._plans.get(gi)
            if plan is not None and plan.fits(params, grads, check_grads=several):
                work.append((gi, group, plan, [grads[i] for i in plan.index]))
                continue
            self._plans.pop(gi, None)
            work.append((gi, group, None, self._checked_with_grad(gi, params, grads)))
        for gi, group, plan, arg in work:
            if plan is not None:
                try:
                    plan.step(group, arg)
                    continue
                except (ValueError, TypeError):  # the binding refused a gradient, before writing anything
                    self._plans.pop(gi, None)
                    params = group["params"]
                    arg = self._checked_with_grad(gi, params, [p.grad for p in params])  # names it, or it is fine
            if arg:
                self._step_group(group, arg)
                self._plans[gi] = _Plan.build(self, group)
        return loss

    @staticmethod
    def _checked_with_grad(gi: int, params: list, grads: list) -> list:
        """The group's parameters that have a gradient, each checked (TypeError/ValueError naming it)."""
        for pi, (p, g) in enumerate(zip(params, grads)):
            if g is not None:
                _check_param(p, gi, pi)
        return [p for p, g in zip(params, grads) if g is not None]

    @property
    def _plans(self) -> dict:
        # Per param group: its checked plan (absent until the group's first step, dropped when
        # the group or the state changes). Kept out of __init__ so load_state_dict's
        # __setstate__ path and unpickled optimizers get one too.
        plans = self.__dict__.get("_zc_plans")
        if plans is None:
            plans = self.__dict__["_zc_plans"] = {}
        return plans

    def _step_group(self, group: dict, with_grad: list) -> None:
        lib = _loader.load("adam")
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
        hyper = _hyper(group)
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


def _hyper(group: dict) -> tuple:
    beta1, beta2 = group["betas"]
    return (float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
            bool(group["decoupled_weight_decay"]), 1.0)


class _Plan:
    """One param group's checked step: which parameters get stepped, their state tensors and
    step counts, all on one device (CPU or one CUDA device), contiguous, float32, one step
    count for all. Built after a full step of the group; valid while the group holds the same
    parameters, the same ones have gradients and the state was not replaced."""

    __slots__ = ("params", "index", "present", "exp_avgs", "exp_avg_sqs", "counts", "count", "device", "numels")

    @staticmethod
    def build(opt: "FusedAdam", group: dict) -> "_Plan | None":
        params = list(group["params"])
        index = [i for i, p in enumerate(params) if p.grad is not None]
        stepped = [params[i] for i in index]
        if not stepped:
            return None
        device = stepped[0].device
        states = [opt.state.get(p) for p in stepped]
        if any(not st for st in states) or any(p.device != device or not p.is_contiguous() for p in stepped):
            return None  # several devices or a non-contiguous parameter: the full path each step
        counts = torch.stack([st["step"] for st in states]).tolist()
        if any(c != counts[0] for c in counts) or device.type not in ("cpu", "cuda"):
            return None  # per-parameter step counts that differ: the full path reads them each step
        plan = _Plan()
        plan.params, plan.index = stepped, index
        plan.present = [g is not None for g in (p.grad for p in params)]
        plan.exp_avgs = [st["exp_avg"] for st in states]
        plan.exp_avg_sqs = [st["exp_avg_sq"] for st in states]
        # The per-parameter step tensors (torch's state layout) become 0-d views of one tensor,
        # so a step bumps them all with one add_ (a _foreach_add_ over 200 scalars costs ~1 ms).
        plan.counts = torch.tensor(counts, dtype=torch.float32)
        for i, st in enumerate(states):
            st["step"] = plan.counts[i]
        plan.count = int(counts[0])
        plan.device = device
        plan.numels = [p.numel() for p in stepped]
        return plan

    def fits(self, params: list, grads: list, *, check_grads: bool) -> bool:
        """Same parameters, gradients on the same ones; with ``check_grads`` also every gradient
        a contiguous float32 tensor of its parameter's size on the plan's device."""
        if len(grads) != len(self.present) or [g is not None for g in grads] != self.present:
            return False
        if not check_grads:
            for i, p in zip(self.index, self.params):
                if params[i] is not p:
                    return False
            return True
        f32, strided = torch.float32, torch.strided
        cuda, index = self.device.type == "cuda", self.device.index
        for i, p, n in zip(self.index, self.params, self.numels):
            g = grads[i]
            if params[i] is not p or g.dtype is not f32 or g.layout is not strided or g.numel() != n \
                    or not g.is_contiguous() or not ((g.is_cuda and g.get_device() == index) if cuda else g.is_cpu):
                return False
        return True

    def step(self, group: dict, grads: list) -> None:
        steps = [self.count + 1] * len(self.params)
        hyper = _hyper(group)
        if self.device.type == "cuda":
            from .cuda import kernels

            kernels.lib().cuda_adam_step_multi(self.params, grads, self.exp_avgs, self.exp_avg_sqs, [], steps, *hyper,
                                               None, kernels.stream_handle(self.device))
        else:
            _loader.load("adam").adam_step_multi(self.params, grads, self.exp_avgs, self.exp_avg_sqs, None, steps,
                                                 *hyper)
        self.counts.add_(1.0)
        self.count += 1


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
