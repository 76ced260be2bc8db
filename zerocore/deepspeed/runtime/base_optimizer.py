"""``deepspeed.runtime.base_optimizer``: DeepSpeed's optimizer base classes, for the ``isinstance`` checks scripts
make on ``engine.optimizer``. Every zerocore engine's optimizer is its ZeRO optimizer face (stage 0 included), so
both names are that class."""
from ...runtime.optimizer_face import ZeroOptimizer

DeepSpeedOptimizer = ZeroOptimizer
ZeROOptimizer = ZeroOptimizer

__all__ = ["DeepSpeedOptimizer", "ZeROOptimizer"]
