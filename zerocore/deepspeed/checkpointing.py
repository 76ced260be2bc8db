"""``deepspeed.checkpointing``: activation checkpointing through ``torch.utils.checkpoint``.

DeepSpeed's options (``partition_activations``, ``cpu_checkpointing``,
``contiguous_memory_optimization``, ...) say where the saved boundary activations live: memory
and time, never values. Here the segment is recomputed in backward with the RNG state of its
forward restored (dropout draws the same mask), so the values match DeepSpeed's."""
from __future__ import annotations

import torch.utils.checkpoint as _torch_checkpoint

_configured = False


def configure(mpu_=None, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> None:
    """Accepted for DeepSpeed scripts; the options change only where activations are kept. A
    model-parallel ``mpu_`` is refused (zerocore is data parallel only)."""
    global _configured
    if mpu_ is not None:
        raise ValueError("zerocore.deepspeed.checkpointing.configure: mpu_ (model parallelism) is not supported")
    _configured = True


def is_configured() -> bool:
    return _configured


def reset() -> None:
    """Nothing is cached between iterations here."""


def checkpoint(function, *args):
    """``function(*args)`` without keeping its inner activations; recomputed in backward."""
    return _torch_checkpoint.checkpoint(function, *args, use_reentrant=False)


non_reentrant_checkpoint = checkpoint

__all__ = ["configure", "is_configured", "reset", "checkpoint", "non_reentrant_checkpoint"]
