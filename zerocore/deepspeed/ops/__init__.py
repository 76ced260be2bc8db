"""``deepspeed.ops``: the Adam classes, backed by zerocore's fused Adam kernel, and
``__compatible_ops__`` (which of DeepSpeed's ops the face offers: ``op_builder.py``)."""
from . import adam, aio, op_builder  # noqa: F401

__compatible_ops__ = {name: builder().is_compatible() for name, builder in op_builder.ALL_OPS.items()}
