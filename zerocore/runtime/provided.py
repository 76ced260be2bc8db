"""What the engine's methods run in the floors above the runtime, handed in from above.

``engine.save_checkpoint`` / ``load_checkpoint`` run the checkpoint package (``rank_file``: its
name of a rank's file), ``engine.memory_report(predicted=True)`` the planner, and a stage-3 engine's
construction the client libraries' adjustments to the model it holds (``adopt_model``: Transformers'
generate). Both packages read or build engines from
runtime pieces, so the runtime importing them would close an import circle (and the planner's
imports cost about a second: sympy, dynamo). Instead the package's top, ``zerocore/_wiring.py``
(imported by ``zerocore/__init__.py``, which runs before any ``zerocore.*`` module can be used),
hands their entry points in with ``provide``; each imports its package on first use.
"""
from __future__ import annotations

from collections.abc import Callable

NAMES = ("save_checkpoint", "save_async", "load_checkpoint", "rank_file", "predict_memory", "adopt_model")
_PROVIDED: dict[str, Callable] = {}


def provide(**fns: Callable) -> None:
    unknown = sorted(set(fns) - set(NAMES))
    if unknown:
        raise ValueError(f"zerocore.runtime.provided: no entry point named {', '.join(unknown)} (known: "
                         f"{', '.join(NAMES)})")
    _PROVIDED.update(fns)


def call(name: str, *args, **kwargs):
    fn = _PROVIDED.get(name)
    if fn is None:
        raise RuntimeError(f"zerocore: {name} was never provided to the runtime: zerocore/_wiring.py provides it when "
                           "the zerocore package is imported (was zerocore/__init__.py changed?)")
    return fn(*args, **kwargs)
