"""Flat groups with their parameters. Stages 1/2 group by size only (``size_groups``); stage 3
makes one group per unit (partitioned), then groups the persistent small parameters by size
(kept whole, like stage 2's parameters).

Unit groups are numbered in the reverse order of their first parameter's registration, which
is close to the order backward completes them (the reducer launches groups in index order).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..config import ZeroOptimizationConfig
from ..sharding import FlatGroup, StagePolicy, build_groups, policy_for
from ..sharding.units import Named, plan_units


@dataclasses.dataclass
class GroupSpec:
    layout: FlatGroup
    params: list[nn.Parameter]
    policy: StagePolicy
    unit: tuple[str, nn.Module] | None  # (module path, module) for a unit's group


def engine_groups(module: nn.Module, trainable: list[Named], z: ZeroOptimizationConfig, world: int,
                  dtype: torch.dtype, policy: StagePolicy) -> list[GroupSpec]:
    """The engine's flat groups for ``z.stage`` (the memory planner builds the same ones)."""
    if z.stage == 3:
        return stage3_groups(module, trainable, z, world, dtype)
    # Groups in reverse registration order: close to the order backward produces gradients,
    # so buckets fill (and launch) one after another.
    return size_groups(list(reversed(trainable)), z.reduce_bucket_size, world, dtype, policy)


def stage3_groups(module: nn.Module, trainable: list[Named], z: ZeroOptimizationConfig, world: int,
                  dtype: torch.dtype) -> list[GroupSpec]:
    units, persistent = plan_units(module, trainable, classes=z.stage3_unit_classes,
                                   min_params=z.stage3_unit_min_params,
                                   persistence_threshold=z.stage3_param_persistence_threshold)
    rank_of = {id(p): i for i, (_, p) in enumerate(trainable)}
    units.sort(key=lambda u: -rank_of[id(u.params[0][1])])
    specs: list[GroupSpec] = []
    for u in units:
        (layout,) = build_groups(u.params, bucket_elems=2**62, world=world, dtype=dtype, first_index=len(specs))
        specs.append(GroupSpec(layout, [p for _, p in u.params], policy_for(3), (u.name, u.module)))
    if persistent:
        specs += size_groups(list(reversed(persistent)), z.reduce_bucket_size, world, dtype, policy_for(2),
                             first_index=len(specs))
    return specs


def size_groups(named: list[Named], bucket_elems: int, world: int, dtype: torch.dtype, policy: StagePolicy,
                first_index: int = 0) -> list[GroupSpec]:
    """Groups of at most ``bucket_elems`` elements over ``named`` in that order (stages 1/2, and
    stage 3's persistent parameters), each with its parameters."""
    specs, i = [], 0
    for layout in build_groups(named, bucket_elems=bucket_elems, world=world, dtype=dtype, first_index=first_index):
        specs.append(GroupSpec(layout, [p for _, p in named[i:i + len(layout.slots)]], policy, None))
        i += len(layout.slots)
    return specs
