"""``deepspeed.runtime.zero.config.DeepSpeedZeroConfig``: a ``zero_optimization`` section as an
object, validated by zerocore's schema (an error names a bad key or value)."""
from __future__ import annotations

import dataclasses

from ....config import load_config
from ...utils.logging import logger


class DeepSpeedZeroConfig:
    """``DeepSpeedZeroConfig(stage=3, ...)``: the section's keys as attributes, zerocore's values for
    the keys it has (DeepSpeed's other spellings translated) and the given value for DeepSpeed's keys
    zerocore accepts without a field. DeepSpeed's deprecation warnings go to
    ``deepspeed.utils.logger``."""

    def __init__(self, **section):
        if section.get("elastic_checkpoint"):
            logger.warning("Elastic checkpointing is deprecated and will be removed; zero_optimization."
                           "elastic_checkpoint has no effect (zerocore's checkpoints load at any world size)")
        cfg = load_config({"zero_optimization": section}).zero_optimization
        for f in dataclasses.fields(cfg):
            setattr(self, f.name, getattr(cfg, f.name))
        for key, value in section.items():
            if not hasattr(self, key):
                setattr(self, key, value)

    def __repr__(self) -> str:
        return f"DeepSpeedZeroConfig({self.__dict__})"
