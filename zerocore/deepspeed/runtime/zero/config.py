"""``deepspeed.runtime.zero.config.DeepSpeedZeroConfig``: a ``zero_optimization`` section as an
object, validated by zerocore's schema (an error names a bad key or value), read as DeepSpeed's
config object reads: its field names beside zerocore's (``prefetch_bucket_size`` for
``stage3_prefetch_bucket_size``), ``overlap_comm`` resolved by the stage, the offload sections
``None`` unless given (DeepSpeed's ``offload_optimizer is None`` test for "no offload")."""
from __future__ import annotations

import dataclasses
import sys
import warnings

from ....config import load_config
from ...utils.logging import logger
from .offload_config import DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig, offload_objects
from ..section_errors import validation_errors

# DeepSpeed's field name -> zerocore's key (DeepSpeed reads the stage3_ spelling as an alias of its field)
DEEPSPEED_FIELDS = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
}
# DeepSpeed's fields zerocore accepts without one of its own: (DeepSpeed's alias, its default)
DEEPSPEED_ONLY = {
    "model_persistence_threshold": ("stage3_model_persistence_threshold", sys.maxsize),
    "module_granularity_threshold": ("stage3_module_granularity_threshold", 0),
    "use_all_reduce_for_fetch_params": ("stage3_use_all_reduce_for_fetch_params", False),
    "allgather_sequential": ("stage3_allgather_sequential", False),
    "pipeline_loading_checkpoint": (None, False),
    "elastic_checkpoint": (None, False),
    "ignore_unused_parameters": (None, True),
    "legacy_stage1": (None, False),
}
_OFFLOAD_KEYS = ("offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory")


class DeepSpeedZeroConfig:
    """``DeepSpeedZeroConfig(stage=3, ...)``: the section's keys as attributes, zerocore's values for
    the keys it has (DeepSpeed's other spellings translated, DeepSpeed's field names too) and the given
    value, else DeepSpeed's default, for DeepSpeed's keys zerocore accepts without a field. DeepSpeed's
    deprecation warnings go to ``deepspeed.utils.logger``."""

    def __init__(self, **section):
        if section.get("elastic_checkpoint"):
            logger.warning("Elastic checkpointing is deprecated and will be removed; zero_optimization."
                           "elastic_checkpoint has no effect (zerocore's checkpoints load at any world size)")
        # the offload sections are validated on their own (a config object may name them at any stage, as
        # DeepSpeed's may; zerocore.initialize refuses parameter offload below stage 3)
        rest = {k: v for k, v in section.items() if k not in _OFFLOAD_KEYS}
        with validation_errors("DeepSpeedZeroConfig", section):
            cfg = load_config({"zero_optimization": rest}).zero_optimization
        for f in dataclasses.fields(cfg):
            setattr(self, f.name, getattr(cfg, f.name))
        for ds_name, key in DEEPSPEED_FIELDS.items():
            setattr(self, ds_name, getattr(cfg, key))
        for ds_name, (alias, default) in DEEPSPEED_ONLY.items():
            setattr(self, ds_name, section.get(ds_name, section.get(alias, default) if alias else default))
        for key, value in rest.items():
            if not hasattr(self, key):
                setattr(self, key, value)
        if self.overlap_comm is None:  # DeepSpeed's validator: on at stage 3, off below
            self.overlap_comm = self.stage == 3
        offload = {k: v for k, v in section.items() if k in _OFFLOAD_KEYS}
        with warnings.catch_warnings():  # (the deprecated spellings warned once already, or warn here once)
            if not any(k in section for k in ("cpu_offload", "cpu_offload_param")):
                warnings.simplefilter("ignore")
            with validation_errors("DeepSpeedZeroConfig", section):
                self.offload_optimizer, self.offload_param = offload_objects(offload)

    def __repr__(self) -> str:
        return f"DeepSpeedZeroConfig({self.__dict__})"


__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig"]
