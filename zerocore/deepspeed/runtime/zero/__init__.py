"""``deepspeed.runtime.zero``: the names DeepSpeed scripts import from here."""
from . import config, leaf_module_config, offload_config, partition_parameters, stage3, tiling, utils  # noqa: F401
from .partition_parameters import DeepSpeedTensorOverride, GatheredParameters, Init, ZeroParamStatus  # noqa: F401
from .partition_parameters import register_external_parameter  # noqa: F401
from .stage3 import unwrap_model_for_generation  # noqa: F401
from .tiling import TiledLinear, TiledLinearReturnBias  # noqa: F401
