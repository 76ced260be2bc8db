"""What ``engine.destroy()`` stops besides giving the model back (``release``): a pending
asynchronous checkpoint is waited for, the host-step worker stopped, the NVMe swap stores closed
(their files removed), the engine's own side group destroyed, and, once no engine is left (after
a collective destroy), the process groups zerocore created (``zerocore.comm.lifetime``: also done at interpreter exit for
engines never destroyed)."""
from __future__ import annotations

from ..comm import lifetime


def close_engine(engine, collective: bool = True) -> None:
    from .checkpoint_marks import wait_pending

    try:
        wait_pending(engine)  # its background barriers need the side group
    finally:
        if engine.offload is not None:
            engine.offload.close()
        side = getattr(engine, "_zc_side_comm", None)
        if side is not None and side.group is not None:
            engine._zc_side_comm = None
            lifetime.release_side_group(side.group)
        lifetime.engine_destroyed(engine, collective)
