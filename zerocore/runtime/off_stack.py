"""Torch's lazy imports, made where they cannot hold an engine.

``torch.optim.Optimizer.add_param_group`` is wrapped by ``torch._disable_dynamo``, whose first call
imports ``torch._dynamo``; during that import ``torch.fx.wrap`` keeps ``inspect.currentframe()`` in a
local, a frame that references itself and, through ``f_back``, every frame below it. Made inside the
first engine's constructor, that cycle keeps the engine, its model and every tensor of both alive
until Python's cyclic collector happens to run. Importing ``torch._dynamo`` with ``import zerocore``
would cost every user ~2 s, so the first engine imports it on a thread of its own: the frames that
cycle keeps are that thread's, which hold nothing of the caller's.
"""
from __future__ import annotations

import importlib
import sys
import threading

_MODULES = ("torch._dynamo",)


def import_off_stack() -> None:
    """Imports torch's lazily imported modules (``_MODULES``) on a helper thread, once per process."""
    missing = [m for m in _MODULES if m not in sys.modules]
    if missing:
        run_on_thread(lambda: [importlib.import_module(name) for name in missing], "zerocore-imports")


def run_on_thread(fn, name: str):
    """``fn()`` on a new thread, waited for: its result returned, its exception raised on the caller's
    thread. What ``fn`` leaves on its own stack (frames, OpenMP thread settings) stays with that thread."""
    result: list = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            errors.append(e)

    t = threading.Thread(target=run, name=name)
    t.start()
    t.join()
    if errors:
        raise errors[0]
    return result[0]
