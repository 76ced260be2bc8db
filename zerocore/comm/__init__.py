"""Every collective zerocore issues lives here: the process group (``group.py``) and the
bucket-level collectives with their per-backend strategy (``collectives.py``)."""
from .collectives import DONE, Comm, Handle
from .group import default_comm, side_comm

__all__ = ["Comm", "Handle", "DONE", "default_comm", "side_comm"]
