"""Which CPU instruction-set path the kernels use, and a way to force one (for tests and
for ruling out a SIMD path when debugging). ZEROCORE_CPU_ISA=scalar|avx2|avx512|auto does the
same for a whole process."""
from __future__ import annotations

import contextlib

from . import _loader


def supported_isas() -> list[str]:
    return list(_loader.load("isa").supported_isas())


def active_isa() -> str:
    return _loader.load("isa").active_isa()


def set_isa(name: str) -> str:
    """Forces ``name`` ('auto' = widest supported); ValueError if this CPU lacks it."""
    return _loader.load("isa").set_isa(name)


@contextlib.contextmanager
def force_isa(name: str):
    before = active_isa()
    set_isa(name)
    try:
        yield
    finally:
        set_isa(before)
