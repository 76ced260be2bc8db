"""zerocore.ops: the Python face of each native kernel, usable on its own.

Each op has a plain-torch reference in ``zerocore.ops.reference``. The native extension is
loaded (or JIT-built) on first use, not at import.
"""
from ._loader import NativeBuildError
from .adam import adam_step, adam_step_multi
from .aio import AsyncIO, aligned_pinned_empty
from .cast import cast
from .checksum import copy_crc32c, crc32c
from .flatten import pack, unpack
from .fused_adam import FusedAdam
from .isa import active_isa, force_isa, set_isa, supported_isas
from .norm import sum_squares, sum_squares_multi

__all__ = ["adam_step", "adam_step_multi", "FusedAdam", "pack", "unpack", "cast", "sum_squares", "sum_squares_multi",
           "crc32c", "copy_crc32c", "active_isa", "force_isa",
           "set_isa", "supported_isas", "NativeBuildError"]
