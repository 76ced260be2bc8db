"""``deepspeed.runtime``: the engine class under DeepSpeed's name and the LR schedules."""
from . import base_optimizer, config, engine, lr_schedules, swap_tensor, torch_autocast, utils, zero  # noqa: F401
