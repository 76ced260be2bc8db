"""Hands the runtime the entry points of the floors above it (``runtime/provided.py``): the
checkpoint package's save and load, the planner's prediction of an engine's memory, the
Transformers integration's adjustment of a stage-3 model. Each imports
its package on first use, as ``zerocore.estimate`` does: the planner's imports cost about a second."""
from __future__ import annotations

import sys

from .runtime import provided


def _save_checkpoint(*args, **kwargs):
    from .checkpoint.save import save_checkpoint

    return save_checkpoint(*args, **kwargs)


def _save_async(*args, **kwargs):
    from .checkpoint.async_save import save_async

    return save_async(*args, **kwargs)


def _load_checkpoint(*args, **kwargs):
    from .checkpoint.load import load_checkpoint

    return load_checkpoint(*args, **kwargs)


def _rank_file(rank: int) -> str:
    from .checkpoint.layout import rank_file

    return rank_file(rank)


def _predict_memory(*args, **kwargs):
    from .planner.engine_view import with_prediction

    return with_prediction(*args, **kwargs)


def _adopt_model(engine):
    """A stage-3 engine: the Transformers models it holds generate under Transformers' own ZeRO-3
    rules (``integrations/transformers/zero3.py``). Only where Transformers is imported already (a
    model of it can be in the engine only then), and only a version the integration supports."""
    if "transformers" not in sys.modules:
        return
    try:
        from .integrations.transformers.zero3 import adopt
    except ImportError:  # a Transformers the integration refuses: its models generate as they would
        return
    adopt(engine)


provided.provide(save_checkpoint=_save_checkpoint, save_async=_save_async, load_checkpoint=_load_checkpoint,
                 rank_file=_rank_file, predict_memory=_predict_memory, adopt_model=_adopt_model)
