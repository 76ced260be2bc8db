"""DeepSpeed's public surface over zerocore: ``import zerocore.deepspeed as deepspeed`` and a script
written for DeepSpeed 0.19 runs on zerocore's engine.

A face, not a second engine: each name maps onto zerocore's own API (``zerocore.initialize``,
``zerocore.init``, ``zerocore.gathered``, the checkpoint module). What zerocore cannot honour
(model parallelism through ``mpu``, pipeline modules, a mesh) is an error naming it, never
silently ignored.
"""
from __future__ import annotations

from . import accelerator, checkpoint, checkpointing, comm, moe, ops, runtime, utils, zero  # noqa: F401
from .git_version_info import git_branch as __git_branch__  # noqa: F401
from .git_version_info import git_hash as __git_hash__  # noqa: F401
from .git_version_info import version as __version__  # noqa: F401
from .comm import init_distributed  # noqa: F401
from .launch import add_config_arguments, initialize  # noqa: F401
from .runtime.config import DeepSpeedConfigError  # noqa: F401
from .runtime.engine import DeepSpeedEngine  # noqa: F401

# DeepSpeed's version attributes (its __init__ parses them from __version__ the same way)
__version_major__, __version_minor__, __version_patch__ = (int(x) for x in __version__.split(".")[:3])

__all__ = ["initialize", "init_distributed", "add_config_arguments", "DeepSpeedEngine", "DeepSpeedConfigError", "zero",
           "comm", "ops", "utils", "runtime", "accelerator", "checkpoint", "checkpointing", "moe"]
