"""Parameters read by a module that does not own them (``self.other.weight``, weights shared
outside the module tree): the owning modules' classes are swapped for subclasses whose
attribute lookup tells the gatherer, which gathers the owning unit on first access (FSDP2
swaps module classes in the same way). ``restore`` undoes the swap.
"""
from __future__ import annotations

from torch import nn

_HOOKED: dict[type, type] = {}


def _with_access_hook(cls: type) -> type:
    """A subclass of ``cls`` whose attribute lookup of a parameter tells the gatherer (FSDP2 swaps
    module classes in the same way). nn.Module.__getattr__ only runs for names not found in the
    instance ``__dict__`` (parameters, buffers, submodules), so other attributes cost nothing."""
    if getattr(cls, "_zc_access_hooked", False):
        return cls
    if cls in _HOOKED:
        return _HOOKED[cls]

    def __getattr__(self, name):
        value = cls.__getattr__(self, name)
        # a partitioned parameter is empty exactly while its unit is not gathered: only then is
        # the gatherer called (no Python call for the usual read of a gathered parameter)
        if isinstance(value, nn.Parameter) and value.numel() == 0:
            g = self.__dict__.get("_zc_gatherer")
            if g is not None:
                g.on_access(value)
        return value

    new = type(cls.__name__, (cls,), {"__getattr__": __getattr__, "_zc_access_hooked": True,
                                      "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    _HOOKED[cls] = new
    return new


def swap_class(module: nn.Module, gatherer) -> type:
    """Gives ``module`` the access-hooked subclass of its class; returns the original class."""
    original = type(module)
    module.__class__ = _with_access_hook(original)
    module.__dict__["_zc_gatherer"] = gatherer
    return original


def restore(module: nn.Module, original: type) -> None:
    module.__class__ = original
    module.__dict__.pop("_zc_gatherer", None)
