"""``deepspeed.runtime``: the engine class under DeepSpeed's name and the LR schedules."""
from . import engine, lr_schedules, zero  # noqa: F401
