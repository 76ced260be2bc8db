"""``deepspeed.utils``: ``zero_to_fp32`` over zerocore's checkpoint module."""
from . import zero_to_fp32  # noqa: F401
