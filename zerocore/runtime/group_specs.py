"""Flat groups with their parameters. Stages 1/2 group by size only (``size_groups``); stage 3
makes one group per unit (partitioned), then groups the persistent small parameters by size
(kept whole, like stage 2's parameters).

Unit groups are numbered in the reverse order of their first parameter's registration, which
is close to the order backward completes them (the reducer launches groups in index order).

Hyper-parameter groups (``param_groups.py``; ``hyper`` maps id(parameter) -> group) are the
fourth grouping key: size groups never mix them (each hyper group is bucketed on its own, and the
buckets are ordered by when backward completes them), and inside a stage-3 unit the parameters
are laid out hyper group by hyper group, so an owned range splits into at most one contiguous
piece per hyper group (``hyper_pieces``), each stepped with its own hyper-parameters.

Stage 3 also partitions frozen parameters: after every trainable group comes one group per unit
holding that unit's frozen parameters (``GroupSpec.frozen``; ``frozen_policy``: no gradients, no
optimizer state), gathered and freed with the unit's trainable group.
"""
from __future__ import annotations

import dataclasses
import fnmatch

import torch
from torch import nn

from ..config import ConfigError, ZeroOptimizationConfig
from ..sharding import FlatGroup, StagePolicy, build_groups, frozen_policy, policy_for
from ..sharding.leaf_modules import leaf_ids
from ..sharding.units import Named, logical_numel, partitioned_frozen, plan_units


@dataclasses.dataclass
class GroupSpec:
    layout: FlatGroup
    params: list[nn.Parameter]
    policy: StagePolicy
    unit: tuple[str, nn.Module] | None  # (module path, module) for a unit's group
    hyper: list[int] = dataclasses.field(default_factory=list)  # each slot's hyper-parameter group
    frozen: bool = False  # a unit's frozen parameters (stage 3): gathered with the unit, never trained


def _no_groups(named) -> dict[int, int]:
    return {id(p): 0 for _, p in named}


def engine_groups(module: nn.Module, trainable: list[Named], z: ZeroOptimizationConfig, world: int,
                  dtype: torch.dtype, policy: StagePolicy, hyper: dict[int, int] | None = None,
                  frozen: list[Named] = ()) -> list[GroupSpec]:
    """The engine's flat groups for ``z.stage`` (the memory planner builds the same ones);
    ``hyper`` maps id(parameter) -> hyper-parameter group (one group when None). ``frozen``: the
    parameters not trained; stage 3 partitions them in groups of their own (``spec.frozen``, after
    every trainable group), below stage 3 they stay whole and get no group."""
    if z.stage == 3:
        return stage3_groups(module, trainable, z, world, dtype, hyper, frozen)
    # Groups in reverse registration order: close to the order backward produces gradients,
    # so buckets fill (and launch) one after another.
    return size_groups(list(reversed(trainable)), z.reduce_bucket_size, world, dtype, policy, hyper=hyper)


def stage3_groups(module: nn.Module, trainable: list[Named], z: ZeroOptimizationConfig, world: int,
                  dtype: torch.dtype, hyper: dict[int, int] | None = None, frozen: list[Named] = ()) -> list[GroupSpec]:
    hyper = hyper if hyper is not None else _no_groups(trainable)
    named = named_persistent(list(trainable) + list(frozen), z.stage3_persistent_param_names)
    units, persistent = plan_units(module, trainable,
                                   frozen=partitioned_frozen(frozen, z.stage3_param_persistence_threshold, named),
                                   classes=z.stage3_unit_classes, min_params=z.stage3_unit_min_params,
                                   persistence_threshold=z.stage3_param_persistence_threshold,
                                   leaves=leaf_ids(module, z.leaf_module), persistent_ids=named)
    # registration order of every parameter: units by their first one (trainable or frozen)
    rank_of = {id(p): i for i, (_, p) in enumerate(named_in_order(module))}
    units.sort(key=lambda u: -min(rank_of[id(p)] for _, p in u.params + u.frozen))
    specs: list[GroupSpec] = []
    for u in units:
        if not u.params:
            continue
        named = sorted(u.params, key=lambda np_: hyper[id(np_[1])])  # stable: registration order per hyper group
        (layout,) = build_groups(named, bucket_elems=2**62, world=world, dtype=dtype, first_index=len(specs))
        specs.append(GroupSpec(layout, [p for _, p in named], policy_for(3), (u.name, u.module),
                               [hyper[id(p)] for _, p in named]))
    if persistent:
        specs += size_groups(list(reversed(persistent)), z.reduce_bucket_size, world, dtype, policy_for(2),
                             first_index=len(specs), hyper=hyper)
    # frozen groups last: the trainable groups' indices are the positions the reducer and optimizer use
    for u in units:
        if u.frozen:
            (layout,) = build_groups(u.frozen, bucket_elems=2**62, world=world, dtype=dtype, first_index=len(specs))
            specs.append(GroupSpec(layout, [p for _, p in u.frozen], frozen_policy(), (u.name, u.module),
                                   frozen=True))
    return specs


def named_persistent(named: list[Named], patterns: list[str]) -> set[int]:
    """ids of the parameters ``zero_optimization.stage3_persistent_param_names`` keeps whole: any of a
    parameter's names (a tied one has several) matching any pattern. A pattern matching none is refused:
    a misspelt name would otherwise leave the weight partitioned without a word."""
    if not patterns:
        return set()
    kept, used = set(), set()
    for names, p in named:
        for pat in patterns:
            if any(fnmatch.fnmatchcase(n, pat) for n in names):
                kept.add(id(p))
                used.add(pat)
    unused = [pat for pat in patterns if pat not in used]
    if unused:
        some = ", ".join(repr(ns[0]) for ns, _ in named[:3])
        raise ConfigError(f"zero_optimization.stage3_persistent_param_names: {unused[0]!r} matches no parameter of "
                          f"the model (its names look like {some}; patterns are fnmatch patterns over whole names)")
    return kept


def named_in_order(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Every distinct parameter of ``module`` in registration order."""
    return list(module.named_parameters())


def _buckets(named: list[Named], bucket_elems: int) -> list[list[Named]]:
    """``named`` cut, in order, into runs of at most ``bucket_elems`` elements (a larger
    parameter gets a run of its own): ``build_groups``'s rule."""
    runs, size = [], 0
    for item in named:
        n = logical_numel(item[1])
        if runs and runs[-1] and size + n <= bucket_elems:
            runs[-1].append(item)
            size += n
        else:
            runs.append([item])
            size = n
    return runs


def size_groups(named: list[Named], bucket_elems: int, world: int, dtype: torch.dtype, policy: StagePolicy,
                first_index: int = 0, hyper: dict[int, int] | None = None) -> list[GroupSpec]:
    """Groups of at most ``bucket_elems`` elements over ``named`` in that order (stages 1/2, and
    stage 3's persistent parameters), each with its parameters. With several hyper groups each
    is bucketed on its own and the buckets are ordered by the position of their last parameter
    in ``named`` (the order backward completes them)."""
    hyper = hyper if hyper is not None else _no_groups(named)
    pos = {id(p): i for i, (_, p) in enumerate(named)}
    by_hyper: dict[int, list[Named]] = {}
    for item in named:
        by_hyper.setdefault(hyper[id(item[1])], []).append(item)
    runs = [run for items in by_hyper.values() for run in _buckets(items, bucket_elems)]
    runs.sort(key=lambda run: pos[id(run[-1][1])])
    ordered, starts = [], []
    for run in runs:
        starts.append(len(ordered))
        ordered += run
    specs, i = [], 0
    for layout in build_groups(ordered, bucket_elems=2**62, world=world, dtype=dtype, split_at=starts,
                               first_index=first_index):
        params = [p for _, p in ordered[i:i + len(layout.slots)]]
        specs.append(GroupSpec(layout, params, policy, None, [hyper[id(p)] for p in params]))
        i += len(layout.slots)
    return specs


def hyper_pieces(spec: GroupSpec, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(a, b, hyper group) covering the owned range [lo, hi) of ``spec``'s flat buffer, in
    coordinates relative to ``lo``: one piece per run of slots of one hyper group (padding goes
    with the last run)."""
    slots = spec.layout.slots
    runs: list[list[int]] = []  # [start, end, hyper]
    for s, h in zip(slots, spec.hyper or [0] * len(slots)):
        if runs and runs[-1][2] == h:
            runs[-1][1] = s.end
        else:
            runs.append([s.offset, s.end, h])
    if not runs:
        return [(0, hi - lo, 0)]
    runs[0][0] = 0
    runs[-1][1] = spec.layout.padded
    out = []
    for a, b, h in runs:
        a, b = max(a, lo), min(b, hi)
        if a < b:
            out.append((a - lo, b - lo, h))
    return out or [(0, hi - lo, runs[-1][2])]
