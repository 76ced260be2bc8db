"""How the ranks of a save or a load end together: a barrier that also fails every rank when any
rank failed, so that no rank publishes or keeps what another could not write or read. Shared by
``save.py`` and ``load.py``."""
from __future__ import annotations

from .layout import CheckpointError


def agree(comm, failed: bool, what: str,
          outcome: str = "Nothing was published; the previous checkpoint is intact") -> None:
    """Every rank learns whether any rank failed; one that did not raises, naming ``what`` the
    others were doing and the ``outcome`` (the failed rank raises its own error)."""
    (n,) = comm.sum_floats([float(failed)])
    if n and not failed:
        raise CheckpointError(f"zerocore checkpoint: {int(n)} other rank(s) failed while {what}; see their error. "
                              + outcome)
