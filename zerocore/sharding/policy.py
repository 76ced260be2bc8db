"""A ZeRO stage is a policy over the one sharding core: three decisions, nothing else.

Frozen parameters (``requires_grad=False``) at stage 3 are partitioned and gathered like trainable
ones, in groups of their own whose policy says they are not trained (``trains``): no gradient
buffer, no optimizer state, no reduction."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class StagePolicy:
    stage: int
    shard_optimizer: bool  # fp32 master, m, v only for the owned chunk (stages 1-3)
    keep_full_grads: bool  # a full gradient buffer per group, reduced at the boundary (stages 0, 1)
    keep_full_params: bool  # full parameters stay gathered between uses (stages 0-2)
    trains: bool = True  # False: a group of frozen parameters (stage 3): no gradients, no optimizer state
    # stages 0/1: the full gradient buffer's dtype where wider than the training dtype (fp32 accumulation of bf16
    # gradients, data_types.grad_accum_dtype); None: the training dtype, .grad a view of the buffer
    grad_dtype: object = None

    def partitions(self, world: int) -> int:
        """How many pieces the optimizer state of a group is split into."""
        return world if self.shard_optimizer else 1


def policy_for(stage: int, grad_dtype=None) -> StagePolicy:
    """Where state rests (device, host, NVMe) is offload's decision (``offload.OffloadPlan``), not a stage's.
    ``grad_dtype``: stages 0/1's gradient buffer dtype when not the training dtype (model_setup.accumulation_dtype)."""
    if stage == 0:
        return StagePolicy(0, shard_optimizer=False, keep_full_grads=True, keep_full_params=True, grad_dtype=grad_dtype)
    if stage == 1:
        return StagePolicy(1, shard_optimizer=True, keep_full_grads=True, keep_full_params=True, grad_dtype=grad_dtype)
    if stage == 2:
        return StagePolicy(2, shard_optimizer=True, keep_full_grads=False, keep_full_params=True)
    if stage == 3:
        return StagePolicy(3, shard_optimizer=True, keep_full_grads=False, keep_full_params=False)
    raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")


def frozen_policy() -> StagePolicy:
    """Stage 3's groups of frozen parameters: partitioned and gathered per unit, never trained."""
    return StagePolicy(3, shard_optimizer=True, keep_full_grads=False, keep_full_params=False, trains=False)
