"""``deepspeed.checkpoint``: the helpers scripts import from ``deepspeed.checkpoint.utils``."""
from . import utils  # noqa: F401
