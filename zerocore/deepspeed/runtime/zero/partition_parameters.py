"""``deepspeed.runtime.zero.partition_parameters``: the names scripts import from here: ``Init``,
``GatheredParameters``, ``ZeroParamStatus`` (the values of a stage-3 parameter's ``ds_status``,
``zerocore/runtime/ds_param_attrs.py``) and ``partitioned_param_data_shape`` (the shape a
partitioned parameter shows between uses)."""
from ....runtime.ds_param_attrs import ZeroParamStatus  # noqa: F401
from ...zero import GatheredParameters, Init  # noqa: F401

partitioned_param_data_shape = [0]

__all__ = ["Init", "GatheredParameters", "ZeroParamStatus", "partitioned_param_data_shape"]
