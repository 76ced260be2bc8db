"""``deepspeed.runtime.zero``: the names DeepSpeed scripts import from here."""
from . import offload_config, partition_parameters  # noqa: F401
from .partition_parameters import GatheredParameters, Init, ZeroParamStatus  # noqa: F401
