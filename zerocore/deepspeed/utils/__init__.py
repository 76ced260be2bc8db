"""``deepspeed.utils``: ``logger`` and ``log_dist``, ``safe_get_full_grad``, ``zero_to_fp32`` over
zerocore's checkpoint module, and ``deepspeed.utils.torch`` (torch version checks)."""
from . import torch, zero_to_fp32  # noqa: F401
from .logging import log_dist, logger  # noqa: F401
from .tensor_fragment import safe_get_full_grad  # noqa: F401

__all__ = ["logger", "log_dist", "safe_get_full_grad", "zero_to_fp32", "torch"]
