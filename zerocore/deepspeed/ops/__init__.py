"""``deepspeed.ops``: the Adam classes, backed by zerocore's fused Adam kernel."""
from . import adam  # noqa: F401
