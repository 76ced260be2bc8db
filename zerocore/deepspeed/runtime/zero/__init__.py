"""``deepspeed.runtime.zero``: the names DeepSpeed scripts import from here."""
from . import config, leaf_module_config, offload_config, partition_parameters, utils  # noqa: F401
from .partition_parameters import DeepSpeedTensorOverride, GatheredParameters, Init, ZeroParamStatus  # noqa: F401
