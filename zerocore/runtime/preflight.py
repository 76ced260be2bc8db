"""What ``zerocore.initialize`` refuses before touching the model, each with an error that
names the problem and what to do instead: a model wrapped by another data-parallel wrapper
(its gradients would be reduced twice), parameters on the meta device (nothing to train
yet), a model another live engine owns (its hooks would fire as well), and a config that
is invalid (a ZeroConfig mutated since construction) or asks for what is not implemented."""
from __future__ import annotations

import gc

import torch

from ..config import ZeroConfig, require_implemented
from .gathered import owner_of
from .release import LOST

_WRAPPERS = {
    "DistributedDataParallel": "torch.nn.parallel.DistributedDataParallel",
    "DataParallel": "torch.nn.DataParallel",
    "FullyShardedDataParallel": "torch.distributed.fsdp.FullyShardedDataParallel",
}


def check_config(cfg: ZeroConfig) -> None:
    cfg.validate()
    require_implemented(cfg)


def check_model(module: torch.nn.Module) -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"zerocore.initialize: model must be a torch.nn.Module, got {type(module).__name__}")
    for cls in type(module).__mro__:
        if cls.__name__ in _WRAPPERS and cls.__module__.startswith("torch"):
            raise TypeError(f"zerocore.initialize: the model is wrapped in {_WRAPPERS[cls.__name__]}, which reduces "
                            "gradients itself (they would be reduced twice); pass the plain module (model.module) "
                            "instead: zerocore does the data parallelism")
        if cls.__name__ == "FSDPModule":
            raise TypeError("zerocore.initialize: the model was sharded by torch's fully_shard (FSDP2), which "
                            "shards and reduces itself; pass a module that fully_shard was not applied to")
    for name, p in module.named_parameters():
        if getattr(p, LOST, False):
            raise ValueError(f"zerocore.initialize: parameter '{name}' has no values: its stage-3 engine was dropped "
                             "without engine.destroy(), or released after an error (leaving a `with` block on an "
                             "exception), when only chunks of it existed. Call engine.destroy() before dropping a "
                             "stage-3 engine to get the model back; now rebuild the model or load its weights from "
                             "a checkpoint")
        if p.device.type == "meta":
            raise ValueError(f"zerocore.initialize: parameter '{name}' is on the meta device (shape {tuple(p.shape)}, "
                             "no values yet). Build the model for real: to build one larger than a rank's memory, "
                             "construct it under `with zerocore.init(config):` (each rank keeps only its part), "
                             "or materialize it (module.to_empty(device=...) and initialize the weights)")
    _check_not_owned(module)


def _check_not_owned(module: torch.nn.Module) -> None:
    found = _owned(module)
    if found is not None:
        gc.collect()  # an engine the user dropped may only wait for the cycle collector
        found = _owned(module)
    if found is not None:
        engine, name = found
        raise RuntimeError(f"zerocore.initialize: parameter '{name}' belongs to a live zerocore engine "
                           f"({_engine_name(engine)}), whose hooks would act on it too. Call engine.destroy() on "
                           "that engine first (or build it with `with zerocore.initialize(...) as engine:`), "
                           "which gives the model back with its full trained values")


def _owned(module):
    for name, p in module.named_parameters():
        engine = owner_of(p)
        if engine is not None:
            return engine, name
    return None


def _engine_name(engine) -> str:
    return (f"Engine at 0x{id(engine):x}: stage {engine.config.zero_optimization.stage}, model "
            f"{type(engine.module).__name__}, {engine.optimizer_steps} optimizer steps")
