"""Which ranks take part: the default torch.distributed process group, one that torchrun's
environment describes, or a world of one (no process group at all)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .collectives import Comm


def default_comm(device: torch.device | None = None) -> Comm:
    """A :class:`Comm` over the default process group.

    If none is initialized but the environment names a rank (``torchrun`` sets RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT), the default group is initialized from it: NCCL for
    CUDA models, gloo otherwise. With neither, training runs as a world of one.
    """
    if dist.is_available() and dist.is_initialized():
        return Comm()
    if dist.is_available() and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
        dist.init_process_group(backend)
        return Comm()
    return Comm.single()
