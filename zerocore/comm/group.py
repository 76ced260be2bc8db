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


def side_comm(comm: Comm) -> Comm:
    """A Comm over a new gloo group of ``comm``'s ranks, for collectives issued from another
    thread (an asynchronous checkpoint's barriers): on a group of their own they never interleave
    with training's collectives on ``comm``. Creating it is a collective: call it on every rank,
    from the main thread."""
    if comm.world == 1:
        return Comm.single()
    ranks = dist.get_process_group_ranks(comm.group) if comm.group is not None else None
    return Comm(dist.new_group(ranks=ranks, backend="gloo"))
