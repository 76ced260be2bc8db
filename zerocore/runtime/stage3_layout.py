"""Stage 3's flat groups: one per unit (partitioned), then the persistent small parameters
(grouped by size, kept whole like stage 2's parameters).

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
    rest = list(reversed(persistent))
    layouts = build_groups(rest, bucket_elems=z.reduce_bucket_size, world=world, dtype=dtype,
                           first_index=len(specs)) if rest else []
    i = 0
    for layout in layouts:
        specs.append(GroupSpec(layout, [p for _, p in rest[i:i + len(layout.slots)]], policy_for(2), None))
        i += len(layout.slots)
    return specs
