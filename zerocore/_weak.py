"""Back-references that do not keep their target alive, so an engine is freed by reference counting.

An engine owns a tree of objects (groups, optimizer shards, reducer, gatherer, offload plan, ...).
Where a child must reach its owner or a peer (a shard its group, the reducer the gatherer, a module
hook the gatherer, the optimizer face the engine), a strong reference would close a cycle, and a
cycle keeps gigabytes of tensors alive until Python's cyclic collector happens to run; a cycle
through a tensor's hooks (held in C++) is not even visible to the collector. So the owner holds its
children strongly and every reference back up or across goes through this module.

Nothing here imports the rest of zerocore: every layer may use it.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable


class EngineGone(RuntimeError):
    """A hook or callback ran after the engine that installed it was freed."""


GONE = ("zerocore: the engine this belongs to was deleted (its memory is freed); call engine.destroy() before "
        "dropping an engine to give the model back, or build a new one with zerocore.initialize")


class back_ref:
    """A data descriptor: ``obj.name = target`` stores a weak reference, ``obj.name`` returns the target
    (None once it was freed, or when None was stored)."""

    def __set_name__(self, owner, name: str) -> None:
        self.slot = "_weak_" + name

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        ref = obj.__dict__.get(self.slot)
        return ref() if ref is not None else None

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.slot] = weakref.ref(value) if value is not None else None


class WeakCall:
    """``bound`` (a bound method) called through a weak reference to its object: calling this while
    the object lives calls the method; afterwards it raises :class:`EngineGone` (or returns
    ``default`` when ``quiet``)."""

    __slots__ = ("_ref", "_func", "_quiet", "_default", "__weakref__")

    def __init__(self, bound: Callable, *, quiet: bool = False, default: Any = None):
        self._ref = weakref.ref(bound.__self__)
        self._func = bound.__func__
        self._quiet, self._default = quiet, default

    def __call__(self, *args, **kwargs):
        obj = self._ref()
        if obj is None:
            if self._quiet:
                return self._default
            raise EngineGone(GONE)
        return self._func(obj, *args, **kwargs)

    def alive(self) -> bool:
        return self._ref() is not None


def weak_call(bound: Callable | None, **kw) -> WeakCall | None:
    """``WeakCall(bound)``, None for None."""
    return None if bound is None else WeakCall(bound, **kw)


def proxy(obj):
    """A weak proxy to ``obj`` (attribute access forwards; raises ReferenceError once it is freed)."""
    return weakref.proxy(obj)


def remove_when_freed(owner, handles: list) -> None:
    """When ``owner`` is freed without having removed its hooks (an engine dropped without
    ``destroy()``), remove them: hooks left on the user's model would call into nothing. ``handles``
    (RemovableHandle-like, with ``remove()``) is the owner's own list, so hooks it removes itself
    first are not removed twice."""
    weakref.finalize(owner, _remove_all, handles)


def _remove_all(handles: list) -> None:
    for h in reversed(handles):  # the last first: a class swapped twice gets its own back
        try:
            h.remove()
        except Exception:  # noqa: BLE001 - a finalizer must not raise; the hook dict may be gone already
            pass
    handles.clear()
