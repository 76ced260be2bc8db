"""``deepspeed.ops.aio``: ``AsyncIOBuilder``, which scripts and tests import from here to ask whether NVMe I/O is
available (``deepspeed.ops.__compatible_ops__[AsyncIOBuilder.NAME]``; zerocore's NVMe I/O is ``zerocore.ops.aio``)."""
from .op_builder import AsyncIOBuilder  # noqa: F401
