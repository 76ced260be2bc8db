"""``deepspeed.runtime.engine.DeepSpeedEngine``: zerocore's engine under DeepSpeed's name, so that
``isinstance(model, DeepSpeedEngine)`` checks in scripts and trainers hold."""
from ...runtime.engine import Engine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
