"""An optimizer passed to ``initialize(optimizer=...)``: what the engine takes from it.

- Adam and AdamW (``torch.optim.Adam``/``AdamW``, ``zerocore.FusedAdam``, DeepSpeed's
  ``FusedAdam``/``DeepSpeedCPUAdam`` recognised by class name, without importing DeepSpeed) are
  read for their defaults and param_groups and stepped by zerocore's fused kernel; Adam's
  decay mode (L2 added to the gradient, or decoupled as AdamW) is kept per group.
- Any other ``torch.optim.Optimizer`` (or an Adam with options the kernel lacks: amsgrad,
  maximize) is stepped as it is, on each rank's flat fp32 shards (``torch_shard_step.py``).
- A callable is called with the parameters (``model_parameters`` or the model's), as DeepSpeed
  does, and its result taken as the optimizer.
"""
from __future__ import annotations

import dataclasses
import warnings

import torch

_DEEPSPEED_ADAMS = {"FusedAdam", "DeepSpeedCPUAdam"}


@dataclasses.dataclass
class ClientOptimizer:
    optimizer: torch.optim.Optimizer | None  # None: the config's optimizer section
    fused_adam: bool  # stepped by zerocore's Adam kernel
    decoupled: bool  # the default weight-decay mode (groups may override with 'decoupled_weight_decay')
    defaults: dict  # the keys a group may carry, with their defaults

    @property
    def name(self) -> str:
        return type(self.optimizer).__name__ if self.optimizer is not None else "the config's optimizer"


def _deepspeed_adam(opt) -> bool:
    cls = type(opt)
    return cls.__name__ in _DEEPSPEED_ADAMS and cls.__module__.startswith("deepspeed")


def _adam_mode(opt) -> bool | None:
    """The default decoupled flag of an Adam the kernel can run, else None."""
    d = opt.defaults
    if any(bool(g.get("amsgrad", False)) or bool(g.get("maximize", False)) for g in opt.param_groups):
        return None
    if _deepspeed_adam(opt):
        if not d.get("bias_correction", True):
            return None
        return bool(getattr(opt, "adam_w_mode", True))
    if isinstance(opt, torch.optim.AdamW):
        return True
    if isinstance(opt, torch.optim.Adam):  # zerocore.FusedAdam is one too (its mode in decoupled_weight_decay)
        return bool(d.get("decoupled_weight_decay", False))
    return None


def from_config(config) -> ClientOptimizer:
    p = config.optimizer.params
    return ClientOptimizer(None, True, config.optimizer.decoupled,
                           {"lr": p.lr, "betas": tuple(p.betas), "eps": p.eps, "weight_decay": p.weight_decay})


def classify(optimizer, config, params_for_callable) -> ClientOptimizer:
    """``optimizer`` as given to initialize (None: the config's section)."""
    if optimizer is None:
        return from_config(config)
    if "optimizer" in getattr(config, "given_sections", ()):
        # DeepSpeed 0.19 trains with the passed optimizer and ignores the section (silently): the
        # same here, so a DeepSpeed script computes the same, but said
        warnings.warn(f"zerocore.initialize: an optimizer was passed ({type(optimizer).__name__}) and the config has "
                      "an 'optimizer' section too; the passed one is used and the section is ignored, as DeepSpeed "
                      "does (remove the section to silence this)", UserWarning, stacklevel=3)
    if not isinstance(optimizer, torch.optim.Optimizer) and callable(optimizer):
        optimizer = optimizer(params_for_callable())
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"zerocore.initialize: optimizer must be a torch.optim.Optimizer (or a callable taking the "
                        f"parameters and returning one); got {type(optimizer).__name__}")
    mode = _adam_mode(optimizer)
    if mode is not None:
        return ClientOptimizer(optimizer, True, mode, dict(optimizer.defaults))
    return ClientOptimizer(optimizer, False, False, dict(optimizer.defaults))


def check_torch_optimizer(client: ClientOptimizer, config) -> None:
    """What a non-Adam client optimizer cannot run with, named at initialize."""
    z = config.zero_optimization
    name = client.name
    if z.offload_optimizer.device == "nvme":
        raise ValueError(f"zero_optimization.offload_optimizer.device: 'nvme' swaps Adam's state (master, m, v) tile by "
                         f"tile; optimizer {name} keeps its own state: use device 'cpu' or 'none' with it, or an "
                         "Adam/AdamW optimizer with NVMe")
    if z.offload_param.device == "nvme":
        raise ValueError(f"zero_optimization.offload_param.device: 'nvme' is not supported with optimizer {name} (only "
                         "with Adam/AdamW); use 'cpu' or 'none'")
    if z.offload_optimizer.device == "cpu" and z.offload_optimizer.ratio < 1.0:
        raise ValueError(f"zero_optimization.offload_optimizer.ratio: {z.offload_optimizer.ratio} splits the step "
                         f"between host and device, which only the Adam kernel does; with optimizer {name} use 1.0")
