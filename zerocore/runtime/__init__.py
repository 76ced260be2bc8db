"""The engine and its public entry, ``zerocore.initialize``."""
from __future__ import annotations

import torch

from ..comm import default_comm
from ..config import load_config
from .engine import Engine
from .deepspeed_methods import build_dataloader
from .gathered import gathered
from .partition_init import init


def initialize(model: torch.nn.Module, config=None, *, model_parameters=None, optimizer=None,
               lr_scheduler=None, training_data=None, collate_fn=None, frozen: bool = False) -> Engine:
    """Wraps ``model`` for ZeRO training over the default torch.distributed process group.

    ``config``: a dict, a path to a DeepSpeed-style JSON file, or a :class:`zerocore.ZeroConfig`.
    With no process group initialized, one is initialized from torchrun's environment if it
    names a rank; otherwise training runs as a world of one.

    ``model_parameters``: the parameters to train (default: every one that requires grad), or a
    list of hyper-parameter groups, dicts with ``params`` and any of ``lr``, ``betas``, ``eps``,
    ``weight_decay`` (defaults: the config's ``optimizer.params``); a parameter of the model in
    no group is not trained. ``optimizer``: a ``torch.optim.Optimizer`` (or a callable taking the
    parameters and returning one) whose class, defaults and param_groups are used instead of the
    config's ``optimizer`` section (given both, the passed one wins, as with DeepSpeed). ``lr_scheduler``: a torch
    ``LRScheduler`` over ``engine.optimizer`` (or over ``optimizer``), or a callable taking
    ``engine.optimizer`` and returning one; it wins over the config's ``scheduler`` section.

    ``frozen``: the engine trains nothing (a reference, teacher or evaluation model): every parameter
    is frozen, at stage 3 partitioned over the ranks and gathered unit by unit in the forward, with no
    gradient buffer and no optimizer state; ``backward``/``step`` are refused (a backward through its
    outputs brings gradients to their inputs). A model with no parameter that requires grad needs it.

    ``training_data``: a torch Dataset; ``engine.training_dataloader`` then reads it over the
    data-parallel ranks, ``train_micro_batch_size_per_gpu`` samples per batch, with ``collate_fn``
    (DeepSpeed's loader: a ``DistributedSampler`` with torch's defaults).
    """
    cfg = load_config(config)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    comm = default_comm(device, cfg.zero_optimization.comm_timeout)
    loader = None
    if training_data is not None:  # checked before the engine takes the model
        loader = build_dataloader(training_data, cfg.batch_sizes(comm.world)[1], comm, collate_fn,
                                  cfg.dataloader_drop_last)
    engine = Engine(model, cfg, comm, model_parameters=model_parameters, optimizer=optimizer,
                    lr_scheduler=lr_scheduler, trains=not frozen)
    engine.training_dataloader = loader
    return engine


__all__ = ["initialize", "Engine", "init", "gathered"]
