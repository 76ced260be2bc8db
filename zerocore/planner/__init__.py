"""Memory planning: what one training step of zerocore will hold per rank, predicted from the
engine's own groups, buckets, units and placements built on fake tensors (``dry_engine``) and a
step traced there (``trace``); ``estimate`` plans one or every sensible configuration and
recommends one; ``measure`` is the measured side used to check the predictions."""
from .api import estimate

__all__ = ["estimate"]
