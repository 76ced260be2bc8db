"""``deepspeed.runtime.zero.partition_parameters``: the names scripts import from here: ``Init``,
``GatheredParameters``, ``DeepSpeedTensorOverride`` (what ``Init(tensor_overrides=...)`` overrides),
``ZeroParamStatus`` (the values of a stage-3 parameter's ``ds_status``,
``zerocore/runtime/ds_param_attrs.py``), ``partitioned_param_data_shape`` (the shape a
partitioned parameter shows between uses) and ``MultipleAllGatherHandles`` (waits on several
all-gather handles as one)."""
from ....runtime.ds_param_attrs import ZeroParamStatus  # noqa: F401
from ...tensor_overrides import DeepSpeedTensorOverride  # noqa: F401
from ...zero import GatheredParameters, Init  # noqa: F401

partitioned_param_data_shape = [0]


class MultipleAllGatherHandles:
    """Several all-gather handles waited on as one: ``wait(handle_dependency)`` waits on each in
    turn, passing ``handle_dependency`` by keyword (as DeepSpeed's), so a handle whose ``wait`` takes
    it keyword-only or as ``**kwargs`` gets it too."""

    def __init__(self, handles):
        self.handles = handles

    def wait(self, handle_dependency: bool = True) -> None:
        for handle in self.handles:
            handle.wait(handle_dependency=handle_dependency)


__all__ = ["Init", "GatheredParameters", "DeepSpeedTensorOverride", "ZeroParamStatus", "partitioned_param_data_shape",
           "MultipleAllGatherHandles"]
