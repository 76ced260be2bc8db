"""Per-group parameter work in one native call each (stage 3's hot path), with plain-Python
equivalents for an extension built before these functions existed.

- ``set_data(params, values)``: ``params[i].data = values[i]`` for every i;
- ``pack_grads(params, offsets, flat)``: every ``params[i].grad`` into ``flat`` at ``offsets[i]``
  (gaps zeroed), then dropped; False (nothing done) when a gradient needs the checked ``pack``;
  ``pack_grads_on(device)`` gives the one for a device (on a GPU with zerocore's CUDA kernels: one
  launch for the whole group, not a copy per gradient);
- ``call_before_node(t, fn)``: ``fn()`` runs when the autograd node that made ``t`` is about to run
  (what ``t.register_hook`` gives); False for a tensor no node made (the caller hooks it itself);
- ``make_access_getattr(fallback)``: stage 3's parameter-access ``__getattr__`` (``sharding/access.py``),
  None without the native extension (access.py then uses its Python one).

``param_ops()`` returns them, chosen once; the engine's groups keep the functions they use.
"""
from __future__ import annotations

import types

from . import _loader


def _set_data(params, values) -> None:
    for p, v in zip(params, values):
        p.data = v


def _pack_grads(params, offsets, flat) -> bool:
    return False  # the caller's checked pack does the work


def _call_before_node(t, fn) -> bool:
    node = t.grad_fn
    if node is None:
        return False
    node.register_prehook(lambda grads: fn())
    return True


_ops: types.SimpleNamespace | None = None


def param_ops() -> types.SimpleNamespace:
    global _ops
    if _ops is None:
        try:
            mod = _loader.load("params")
        except Exception:  # no native extension at all: the Python equivalents
            mod = None
        _ops = types.SimpleNamespace(
            set_data=getattr(mod, "set_data", _set_data),
            pack_grads=getattr(mod, "pack_grads", _pack_grads),
            call_before_node=getattr(mod, "call_before_node", _call_before_node),
            make_access_getattr=getattr(mod, "make_access_getattr", None))
    return _ops


def pack_grads_on(device):
    """``pack_grads`` for buckets on ``device``: the CUDA binding's (one launch for the group, on the
    device's current stream) where the CUDA kernels are built, else the native CPU one's."""
    from .cuda import _lib as cuda

    native = getattr(cuda.lib(), "cuda_pack_grads", None) if getattr(device, "type", None) == "cuda" and \
        cuda.available() else None
    if native is None:  # a CPU device, no CUDA kernels, or an extension built before this function
        return param_ops().pack_grads
    stream_of = cuda.stream_handle

    def pack_grads(params, offsets, flat) -> bool:
        return native(params, offsets, flat, stream_of(flat.device))
    return pack_grads
