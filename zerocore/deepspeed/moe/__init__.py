"""``deepspeed.moe``: only ``deepspeed.moe.utils``'s parameter-group helpers; zerocore has no
expert parallelism (no MoE layer)."""
from . import utils  # noqa: F401
