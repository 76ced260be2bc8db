"""``deepspeed.runtime.zero.offload_config``: the enums ``engine.offload_states()`` takes, and the offload
sections as objects (``DeepSpeedZeroOffloadOptimizerConfig``, ``DeepSpeedZeroOffloadParamConfig``), validated by
zerocore's schema."""
from __future__ import annotations

import dataclasses

from ....config import load_config
from ....runtime.offload_states import OffloadDevice as OffloadDeviceEnum  # noqa: F401
from ....runtime.offload_states import OffloadStateType as OffloadStateTypeEnum  # noqa: F401
from ..section_errors import validation_errors


def _section(key: str, section: dict):
    # stage 3: an offload section alone may name parameter offload (its stage is the config's business)
    return getattr(load_config({"zero_optimization": {"stage": 3, key: section}}).zero_optimization, key)


class _OffloadSection:
    KEY = ""

    def __init__(self, _values=None, **section):
        if _values is None:
            with validation_errors(type(self).__name__, section):
                _values = _section(self.KEY, section)
        for f in dataclasses.fields(_values):
            setattr(self, f.name, getattr(_values, f.name))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class DeepSpeedZeroOffloadOptimizerConfig(_OffloadSection):
    """``zero_optimization.offload_optimizer`` as an object; ``pipeline``: either NVMe pipelining switch on."""
    KEY = "offload_optimizer"

    @property
    def pipeline(self) -> bool:
        return bool(self.pipeline_read or self.pipeline_write)


class DeepSpeedZeroOffloadParamConfig(_OffloadSection):
    """``zero_optimization.offload_param`` as an object."""
    KEY = "offload_param"


def offload_objects(offload: dict):
    """(offload_optimizer, offload_param) of a section's offload keys as DeepSpeed's config object has them:
    None where not given (or given as null), else the section's object; the deprecated ``cpu_offload`` /
    ``cpu_offload_param`` read as device ``cpu``."""
    if not offload:
        return None, None
    z = load_config({"zero_optimization": {"stage": 3, **offload}}).zero_optimization
    opt = offload.get("offload_optimizer") is not None or bool(offload.get("cpu_offload"))
    par = offload.get("offload_param") is not None or bool(offload.get("cpu_offload_param"))
    return (DeepSpeedZeroOffloadOptimizerConfig(z.offload_optimizer) if opt else None,
            DeepSpeedZeroOffloadParamConfig(z.offload_param) if par else None)
