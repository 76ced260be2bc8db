"""The one sharding core every ZeRO stage is a policy of.

records.py  ParamSlot / FlatGroup: which bytes belong to which parameter (pure data)
state.py    per-group ParamState / GradState with asserted transitions
policy.py   StagePolicy: the three decisions that make a stage
group.py    ShardedGroup: a FlatGroup plus the tensors one rank holds for it
offloaded.py GroupOffload: what offload hands a group (its shard, readiness, on-gather action)
reducer.py  GradReducer: grad hooks -> buckets -> (async) reduce-scatter -> owned slice
optimizer.py OptimizerShard: fp32 master, m, v of the owned range; the fused Adam step
"""
from .group import ShardedGroup
from .optimizer import AdamHyper, OptimizerShard
from .policy import StagePolicy, frozen_policy, policy_for
from .records import ALIGN_ELEMS, FlatGroup, ParamSlot, build_groups, padded_size
from .reducer import GradReducer
from .state import GradState, ParamState, StateError

__all__ = ["ShardedGroup", "OptimizerShard", "AdamHyper", "StagePolicy", "policy_for", "frozen_policy", "FlatGroup", "ParamSlot",
           "build_groups", "padded_size", "ALIGN_ELEMS", "GradReducer", "GradState", "ParamState", "StateError"]
