"""The engine and its public entry, ``zerocore.initialize``."""
from __future__ import annotations

import torch

from ..comm import default_comm
from ..config import load_config
from .engine import Engine
from .gathered import gathered
from .partition_init import init


def initialize(model: torch.nn.Module, config=None) -> Engine:
    """Wraps ``model`` for ZeRO training over the default torch.distributed process group.

    ``config``: a dict, a path to a DeepSpeed-style JSON file, or a :class:`zerocore.ZeroConfig`.
    With no process group initialized, one is initialized from torchrun's environment if it
    names a rank; otherwise training runs as a world of one.
    """
    cfg = load_config(config)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return Engine(model, cfg, default_comm(device, cfg.zero_optimization.comm_timeout))


__all__ = ["initialize", "Engine", "init", "gathered"]
