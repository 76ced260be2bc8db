"""``deepspeed.runtime.zero.partition_parameters``: the names scripts import from here: ``Init``,
``GatheredParameters``, ``DeepSpeedTensorOverride`` (what ``Init(tensor_overrides=...)`` overrides),
``ZeroParamStatus`` (the values of a stage-3 parameter's ``ds_status``,
``zerocore/runtime/ds_param_attrs.py``), ``partitioned_param_data_shape`` (the shape a
partitioned parameter shows between uses), ``MultipleAllGatherHandles`` (waits on several
all-gather handles as one) and ``_contradicting_single_rank_pg_error`` (DeepSpeed's name of the check every
engine and ``Init`` make: a group of one rank where the launcher started several)."""
import os

from ....comm.group import contradicting_single_rank_error
from ....runtime.ds_param_attrs import ZeroParamStatus  # noqa: F401
from ....sharding.external import register_external_parameter, unregister_external_parameter  # noqa: F401
from ...tensor_overrides import DeepSpeedTensorOverride  # noqa: F401
from ...zero import GatheredParameters, Init  # noqa: F401

partitioned_param_data_shape = [0]


def _contradicting_single_rank_pg_error(dp_world_size: int, explicit_process_group=None, env=None):
    """The error message (None: no contradiction) of a data-parallel group of ``dp_world_size`` ranks where
    ``env`` (default ``os.environ``) says the launcher started ``WORLD_SIZE`` processes."""
    return contradicting_single_rank_error(dp_world_size, explicit_process_group, os.environ if env is None else env)


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
           "MultipleAllGatherHandles", "register_external_parameter", "unregister_external_parameter"]
