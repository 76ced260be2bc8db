"""``deepspeed.runtime``: the engine class under DeepSpeed's name and the LR schedules."""
from . import config, engine, lr_schedules, swap_tensor, utils, zero  # noqa: F401
