"""Parameters read by a module that does not own them (``self.other.weight``, weights shared
outside the module tree): the owning modules' classes are swapped for subclasses whose
attribute lookup tells the gatherer, which gathers the owning unit on first access (FSDP2
swaps module classes in the same way). ``restore`` undoes the swap.

The swap is made once: toggling a module's class with its unit's state was measured ~15 us per
unit slower (CPython's attribute caches are per type, and every toggle misses them). The lookup
is native where the extension is built (``ops.params``), so reading a parameter costs about what
nn.Module's own lookup does, and no zerocore Python frame.
"""
from __future__ import annotations

import copy

from torch import nn

from ..ops.params import param_ops
from .eager import eager_only

_HOOKED: dict[type, type] = {}
_TRACEABLE: dict[type, type] = {}


def _with_access_hook(cls: type) -> type:
    """A subclass of ``cls`` whose attribute lookup of a parameter tells the gatherer (FSDP2 swaps
    module classes in the same way). ``__getattr__`` only runs for names not found in the instance
    ``__dict__`` (parameters, buffers, submodules), so other attributes cost nothing."""
    if getattr(cls, "_zc_access_hooked", False):
        return cls
    if cls in _HOOKED:
        return _HOOKED[cls]

    def __getattr__(self, name):
        # nn.Module.__getattr__'s parameter lookup, inline: reading a parameter costs one Python
        # frame, as it does without the hook. A partitioned parameter is empty exactly while its
        # unit is not gathered: only then is the gatherer called.
        p = self.__dict__["_parameters"].get(name)
        if p is None:
            return cls.__getattr__(self, name)
        if p.numel() == 0:
            g = self.__dict__.get("_zc_gatherer")
            if g is not None:
                g.on_access(p)
        return p

    def __getattr_own__(self, name):  # a class with a __getattr__ of its own: it decides first
        value = cls.__getattr__(self, name)
        if isinstance(value, nn.Parameter) and value.numel() == 0:
            g = self.__dict__.get("_zc_gatherer")
            if g is not None:
                g.on_access(value)
        return value

    if cls.__getattr__ is not nn.Module.__getattr__:
        hook = __getattr_own__
    else:  # native where built: a parameter read then runs no zerocore Python code
        native = param_ops().make_access_getattr
        hook = native(nn.Module.__getattr__) if native is not None else __getattr__
    new = type(cls.__name__, (cls,), {"__getattr__": hook, "_zc_access_hooked": True,
                                      "__deepcopy__": _deepcopy_unhooked, "__module__": cls.__module__,
                                      "__qualname__": cls.__qualname__})
    _HOOKED[cls] = new
    return new


def _deepcopy_unhooked(self, memo):
    """``copy.deepcopy`` of a module whose class the engine swapped: a module of its own class, not tied to the
    engine (its gatherer, and through it the engine's groups and buffers, are not copied); its parameters copy as
    parameters do (a partitioned one is refused: ``runtime/ds_param_attrs.py``)."""
    cls = type(self)
    while "_zc_access_hooked" in cls.__dict__ or "_zc_stage3_class" in cls.__dict__:
        cls = cls.__mro__[1]  # past each class the engine made (also Transformers generate's, zero3.py)
    new = cls.__new__(cls)
    memo[id(self)] = new
    state = {k: v for k, v in self.__dict__.items() if k != "_zc_gatherer"}
    new.__setstate__(copy.deepcopy(state, memo))
    return new


def _tell(module: nn.Module, p: nn.Parameter) -> None:
    """The gatherer hears of a read of an empty parameter (run eagerly under ``torch.compile``: marked
    by ``_with_traceable_access_hook``, not at import, which would import ``torch._dynamo`` with
    ``import zerocore``: seconds for every user, and on the caller's stack, see runtime/off_stack.py)."""
    g = module.__dict__.get("_zc_gatherer")
    if g is not None:
        g.on_access(p)


def _with_traceable_access_hook(cls: type) -> type:
    """The access-hooked subclass for modules inside a unit compiled on its own (stage 3's
    ``engine.compile()``): its ``__getattr__`` is a plain Python function Dynamo inlines (it refuses
    the native one, breaking the graph at every parameter read). Traced, a read of a gathered
    parameter is nn.Module's lookup (the numel test is decided by the shape guard, at trace time);
    a read of an empty one (another unit's parameter) calls the gatherer eagerly: a graph break,
    only where such a read is."""
    if cls in _TRACEABLE:
        return _TRACEABLE[cls]
    eager_only(_tell)  # idempotent: marks the code object
    base_getattr = cls.__getattr__

    def __getattr__(self, name):
        value = base_getattr(self, name)
        if isinstance(value, nn.Parameter) and value.numel() == 0:
            _tell(self, value)
        return value

    new = type(cls.__name__, (cls,), {"__getattr__": __getattr__, "_zc_access_hooked": True,
                                      "__deepcopy__": _deepcopy_unhooked, "__module__": cls.__module__,
                                      "__qualname__": cls.__qualname__})
    _TRACEABLE[cls] = new
    return new


def make_traceable(module: nn.Module, original: type) -> None:
    """``module`` (access-hooked, its own class ``original``) gets the traceable variant of the hook."""
    module.__class__ = _with_traceable_access_hook(original)


def swap_class(module: nn.Module, gatherer) -> type:
    """Gives ``module`` the access-hooked subclass of its class; returns the original class."""
    original = type(module)
    module.__class__ = _with_access_hook(original)
    module.__dict__["_zc_gatherer"] = gatherer
    return original


def restore(module: nn.Module, original: type) -> None:
    module.__class__ = original
    module.__dict__.pop("_zc_gatherer", None)
