"""``torch_autocast`` (DeepSpeed's section): the (device type, dtype) the engine's forward runs under
``torch.autocast`` with, or None. The parameters, gradients, reductions and the optimizer keep the training
dtype; only the forward's autocast-listed operations compute in the lower dtype, as torch AMP does."""
from __future__ import annotations

import torch

from ..config import ConfigError
from ..config.schema import AUTOCAST_DTYPES
from .buffer_dtypes import DTYPES


def autocast_dtype(section, device_type: str) -> torch.dtype:
    """The ``torch_autocast`` section's dtype for ``device_type`` (null: torch's autocast default there)."""
    if section.dtype is None:
        return torch.get_autocast_dtype(device_type)
    return DTYPES[AUTOCAST_DTYPES[section.dtype]]


def forward_autocast(config, device: torch.device) -> tuple[str, torch.dtype] | None:
    ac = config.torch_autocast
    if not ac.enabled:
        return None
    dtype = autocast_dtype(ac, device.type)
    if dtype == torch.float16 and config.zero_optimization.stage == 0:  # (null resolved: CUDA's default)
        raise ConfigError(f"torch_autocast.dtype: {ac.dtype!r} is float16 on {device.type} at zero_optimization.stage "
                          "0; allowed there: bfloat16 (float16 autocast needs a loss scale, which DeepSpeed adds at "
                          "stage 0 with torch's GradScaler and zerocore applies only with fp16.enabled)")
    return device.type, dtype
