"""``deepspeed.utils.logger`` (the ``logging`` logger named "DeepSpeed", as DeepSpeed's) and
``log_dist`` (log on some ranks only). Scripts log through them, and tests patch ``logger.warning``
to see what the face warns about."""
from __future__ import annotations

import logging

import torch.distributed as dist

logger = logging.getLogger("DeepSpeed")


def log_dist(message: str, ranks=None, level: int = logging.INFO) -> None:
    """Logs ``message`` on the ranks in ``ranks`` (every rank when ``ranks`` is None or holds -1, as
    DeepSpeed's)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")
