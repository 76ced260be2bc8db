"""Parameters a module's forward uses although they belong to another module and are not read
through an attribute of their owner (``self.other.weight`` is seen without help: access.py): a
tensor kept in a list, a parametrization's originals reached by reference, a weight handed over by
a caller. ``register_external_parameter(module, p)`` (DeepSpeed's call, same meaning) says so: at
stage 3, whenever ``module``'s forward runs, ``p``'s unit is gathered for the unit running it,
freed after that unit's forward and gathered again before its backward. At stages 0-2 nothing is
partitioned and the record changes nothing.

A parameter returned by the module owning it (``return out, self.bias``) needs no registration:
the gatherer keeps it for the caller by itself (``ParamGatherer``'s post-forward hook).

The record lives on the module (``_zc_external_params``, a list: ids would go stale in a deep
copy), so a registration made while the model is built, before any engine, is found when the
engine's gatherer is built; one made later reaches the live gatherers holding the module.
"""
from __future__ import annotations

import weakref

from torch import nn

KEY = "_zc_external_params"
_LIVE: weakref.WeakSet = weakref.WeakSet()  # gatherers alive: told of registrations made after they were built


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """``parameter`` is used by ``module``'s forward (see the module docstring). Registering it twice
    is one registration."""
    _check(module, parameter, "register_external_parameter")
    held = module.__dict__.setdefault(KEY, [])
    if not any(p is parameter for p in held):
        held.append(parameter)
    for g in list(_LIVE):
        g.watch_external(module)


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undoes ``register_external_parameter``; a parameter not registered on ``module`` is an error."""
    _check(module, parameter, "unregister_external_parameter")
    held = module.__dict__.get(KEY, [])
    for i, p in enumerate(held):
        if p is parameter:
            del held[i]
            return
    raise RuntimeError(f"unregister_external_parameter: the parameter (shape {tuple(parameter.shape)}) is not a "
                       f"registered external parameter of this {type(module).__name__}")


def external_parameters(module: nn.Module) -> list:
    """The parameters registered on ``module`` (a new list)."""
    return list(module.__dict__.get(KEY, ()))


def track(gatherer) -> None:
    """``gatherer`` hears of registrations made from now on (weakly held)."""
    _LIVE.add(gatherer)


def untrack(gatherer) -> None:
    """``gatherer`` has removed its hooks: it hears of nothing more."""
    _LIVE.discard(gatherer)


def _check(module, parameter, what: str) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{what}: the module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(parameter, nn.Parameter):
        # RuntimeError, as DeepSpeed raises for this call
        raise RuntimeError(f"{what}: Parameter is not a torch.nn.Parameter (got {type(parameter).__name__})")
