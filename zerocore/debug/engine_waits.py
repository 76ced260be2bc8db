"""``ZEROCORE_DEBUG_HOST_WAITS=count|raise``: the engine's own host-wait watch, per step.

Read once at engine construction. Set, the engine's ``forward``, ``backward`` and ``step`` run
inside :func:`zerocore.debug.host_waits` (with the engine's training device as "the device", so a
CPU engine counts the call sites a GPU engine would wait at), and at each accumulation boundary
``engine.host_waits_last_step`` becomes the :class:`HostWaitLog` of that window's calls (every
micro-batch's forward and backward and the boundary's step). ``raise``: the first wait raises
:class:`HostWaitError` naming its call site. Unset (or empty): nothing is wrapped, no cost.
"""
from __future__ import annotations

import functools
import os
import weakref

from .host_waits import HostWaitLog, host_waits

ENV = "ZEROCORE_DEBUG_HOST_WAITS"
_MODES = ("count", "raise")


def mode_from_env() -> str | None:
    value = os.environ.get(ENV, "").strip().lower()
    if not value or value in ("0", "off", "none"):
        return None
    if value not in _MODES:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(_MODES)} (or unset)")
    return value


def watch_engine(engine) -> None:
    """Wraps ``engine``'s forward/backward/step as instance attributes when the variable asks for it
    (the class's methods stay as they are: an engine built without it pays nothing)."""
    mode = mode_from_env()
    engine.host_waits_last_step = None
    if mode is None:
        return
    watch = _StepWatch(engine, raise_on_wait=mode == "raise")
    for name in ("forward", "backward", "step"):
        object.__setattr__(engine, name, watch.wrap(getattr(type(engine), name), ends_window=name == "step"))


class _StepWatch:
    def __init__(self, engine, *, raise_on_wait: bool):
        self.device = engine.device
        self.raise_on_wait = raise_on_wait
        self.log = HostWaitLog()
        self._engine = weakref.ref(engine)  # the wrappers live in the engine's __dict__: no cycle back

    def wrap(self, function, *, ends_window: bool):
        @functools.wraps(function)
        def watched(*args, **kwargs):
            engine = self._engine()
            steps = engine.global_steps
            with host_waits(self.raise_on_wait, device=self.device, log=self.log):
                out = function(engine, *args, **kwargs)
            if ends_window and engine.global_steps != steps:
                engine.host_waits_last_step, self.log = self.log, HostWaitLog()
            return out

        return watched
