"""zerocore's config: one schema (``schema.py``) read from DeepSpeed JSON, dicts, or ColossalAI's
form (``parse.py``; other libraries' spellings are translated in ``compat/``), with its
documentation generated from it (``docs.py``)."""
from .options import ConfigError
from .parse import ConfigWarning, load_config, pending_features, require_implemented
from .schema import (AioConfig, BF16Config, FP16Config, OffloadOptimizerConfig, OffloadParamConfig,
                     OptimizerConfig, OptimizerParams, SchedulerConfig, ZeroConfig, ZeroOptimizationConfig)

__all__ = ["ConfigError", "ConfigWarning", "load_config", "pending_features", "require_implemented", "ZeroConfig",
           "ZeroOptimizationConfig", "OffloadOptimizerConfig", "OffloadParamConfig", "FP16Config", "BF16Config",
           "OptimizerConfig", "OptimizerParams", "SchedulerConfig", "AioConfig"]
