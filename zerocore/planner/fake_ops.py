"""zerocore's native kernels read and write raw memory, which fake tensors do not have. While a
dry run traces a step, the few kernels the reducer and the offload landing call are answered for
fake tensors by what they do to memory: nothing (they work in place and allocate nothing); any
real tensor still goes to the kernel, so a training thread running beside a dry run is unaffected."""
from __future__ import annotations

import contextlib

import torch

from torch._subclasses.fake_tensor import FakeTensor

from .. import ops

_ORIGINAL = {}


def _any_fake(*args) -> bool:
    for a in args:
        if isinstance(a, FakeTensor):
            return True
        if isinstance(a, (list, tuple)) and any(isinstance(t, FakeTensor) for t in a):
            return True
    return False


def _pack(grads, offsets, out, *a, **k):
    if _any_fake(grads, out):
        return out
    return _ORIGINAL["pack"](grads, offsets, out, *a, **k)


def _sum_squares(t, *a, **k):
    if _any_fake(t):
        return 0.0, False
    return _ORIGINAL["sum_squares"](t, *a, **k)


def _cast(src, dst=None, dtype=None):
    if _any_fake(src, dst):
        return dst if dst is not None else torch.empty_like(src, dtype=dtype)
    return _ORIGINAL["cast"](src, dst, dtype)


_REPLACEMENTS = {"pack": _pack, "sum_squares": _sum_squares, "cast": _cast}


@contextlib.contextmanager
def fake_aware_kernels():
    """Within: ``zerocore.ops.pack`` / ``sum_squares`` / ``cast`` accept fake tensors."""
    saved = {name: getattr(ops, name) for name in _REPLACEMENTS}
    _ORIGINAL.update(saved)
    try:
        for name, fn in _REPLACEMENTS.items():
            setattr(ops, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(ops, name, fn)
