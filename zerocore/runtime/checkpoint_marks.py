"""The marks that checkpoints leave on an engine, and the checks that read them.

The checkpoint package (a floor above the runtime: it reads and writes engines) sets them, and
the engine reads them itself: ``step()`` refuses a state that a failed load overwrote,
``destroy()`` waits for an asynchronous save, ``zerocore.gathered`` notes an edit. So they live
here, below both, and the runtime never imports the checkpoint package.

- ``_zc_pending_save``: an asynchronous save in flight (``checkpoint/async_save.py``);
  ``wait_pending`` waits for it before anything that needs the state or the side group it uses.
- ``_zc_state_lost``: the path of a load that failed after it had begun writing the optimizer
  state in place (``checkpoint/load.py``); ``check_state_whole`` refuses to step or save until a
  load succeeds.
- ``_zc_state_written``: the state holds more than its initialisation (a load, an edit of the
  parameters), so a load does not go in place by default (``checkpoint/load_in_place.py``).

``CheckpointError`` is defined here because ``check_state_whole`` raises it from the engine's
``step()``; ``zerocore.checkpoint`` exports it under its own name.
"""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, incomplete, corrupt, or of another model; or an
    engine whose optimizer state a failed load overwrote."""


def wait_pending(engine) -> None:
    """Waits for the engine's asynchronous save, if one is in flight (its error is raised here)."""
    pending = getattr(engine, "_zc_pending_save", None)
    if pending is not None:
        engine._zc_pending_save = None
        pending.wait()


def check_state_whole(engine, what: str) -> None:
    """Raises where a failed in-place load left the optimizer state partly overwritten."""
    lost = getattr(engine, "_zc_state_lost", None)
    if lost is not None:
        raise CheckpointError(f"zerocore: {what} refused: a load of {lost} failed after it had begun writing the "
                              "optimizer state in place; load a good checkpoint first")


def mark_written(engine) -> None:
    """The state now holds more than its initialisation (a load, an edit of the parameters)."""
    engine._zc_state_written = True


def state_written(engine) -> bool:
    return getattr(engine, "_zc_state_written", False)
