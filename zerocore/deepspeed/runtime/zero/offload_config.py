"""``deepspeed.runtime.zero.offload_config``: the enums ``engine.offload_states()`` takes."""
from ....runtime.offload_states import OffloadDevice as OffloadDeviceEnum  # noqa: F401
from ....runtime.offload_states import OffloadStateType as OffloadStateTypeEnum  # noqa: F401
