"""``deepspeed.runtime.zero.stage3.unwrap_model_for_generation`` (also importable from
``deepspeed.runtime.zero``): ``with unwrap_model_for_generation(engine) as model:`` gathers every parameter once and
yields ``engine``, so each forward of a generation inside runs on the whole model.

DeepSpeed removes its stage-3 module hooks for the block (its forward would otherwise partition each module again
after use) and puts them back after. zerocore's ``gathered`` keeps the units it gathered whole through the forwards
inside it, so the hooks stay; the parameters rest partitioned again after the block. A collective: every rank
enters it (and, for generation across ranks, Transformers' ``synced_gpus`` keeps them in step)."""
from __future__ import annotations

import contextlib

from ...zero import GatheredParameters


@contextlib.contextmanager
def unwrap_model_for_generation(model):
    with GatheredParameters(list(model.parameters())):
        yield model
