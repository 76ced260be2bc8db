"""Stage 3's frozen parameters at run time: one partitioned group per unit, never trained.

DeepSpeed's ZeRO-3 partitions every parameter, frozen or not, and that is what ZeRO-3 with LoRA /
PEFT is for: the frozen base is most of the model. A unit's frozen parameters (``GroupSpec.frozen``,
planned by ``group_specs.stage3_groups``) go into a ``ShardedGroup`` of their own with the frozen
policy: the owned chunk in the training dtype is all a rank keeps (no gradient buffer, no fp32
master, no moments, no reduction), and the gatherer all-gathers it with the unit's trainable group.

These groups live in ``engine.frozen_groups``, apart from ``engine.groups``: everything that pairs
``engine.groups`` with ``engine.shards`` (the reducer, the optimizer step, the optimizer state in
checkpoints) never sees them. Their indices follow the trainable groups' (``group_at``).

Frozen parameters that stay whole (stages 0-2, persistent or non-floating ones at stage 3) are
converted and synced by ``model_setup.convert_rest`` as before.
"""
from __future__ import annotations

import torch

from ..comm import Comm
from ..sharding import ShardedGroup
from .partition_init import initial_value


@torch.no_grad()
def build_frozen_group(spec, comm: Comm, device: torch.device, offload=None) -> ShardedGroup:
    """The group of ``spec`` (a ``GroupSpec`` with ``frozen`` set): its values in the training dtype,
    broadcast from rank 0 (every rank starts identical, as DDP and the trainable groups do), then cut
    to this rank's chunk; each parameter is the empty tensor until its unit is gathered. Only this
    one unit's frozen parameters are ever whole here at once (also for ``zerocore.init`` models)."""
    layout = spec.layout
    flat = torch.zeros(layout.padded, dtype=layout.dtype, device=device)
    for slot, p in zip(layout.slots, spec.params):
        flat[slot.offset:slot.end] = initial_value(p, comm)  # rounded to the training dtype as .to() does
    comm.broadcast(flat)
    g = ShardedGroup(layout, spec.params, spec.policy, comm.rank, device, param_flat=flat)
    if offload is not None:
        offload.place_frozen(g)  # offload_param: the chunk rests in host memory
    g.bind_params()  # each parameter a view of the flat buffer: its own full tensor is released
    g.free_full()
    return g


def frozen_specs(specs) -> tuple[list, list]:
    """(trainable specs, frozen specs) of ``engine_groups``' list."""
    return [s for s in specs if not s.frozen], [s for s in specs if s.frozen]


def whole_frozen(frozen, frozen_groups: list[ShardedGroup]) -> list:
    """The frozen (names, parameter) pairs no frozen group holds: they stay whole on every rank."""
    held = {id(p) for g in frozen_groups for p in g.params}
    return [(n, p) for n, p in frozen if id(p) not in held]


def gatherer_units(units: list[tuple], frozen_specs_groups: list[tuple]) -> list[tuple]:
    """The gatherer's units: ``units`` (path, module, trainable group) with each unit's frozen group
    added as its extra; a unit with only frozen parameters gets (path, module, frozen group).
    ``frozen_specs_groups``: (spec, group) of every frozen group."""
    frozen_of = {id(spec.unit[1]): (spec.unit[0], spec.unit[1], g) for spec, g in frozen_specs_groups
                 if spec.unit is not None}  # (the planner's rebuilt layouts have no modules)
    out = []
    for path, module, g in units:
        f = frozen_of.pop(id(module), None)
        out.append((path, module, g, f[2] if f is not None else None))
    out += list(frozen_of.values())
    return out


def group_at(engine, index: int) -> ShardedGroup:
    """The engine's group of index ``index``: a trainable one, or a frozen one after them."""
    n = len(engine.groups)
    return engine.groups[index] if index < n else engine.frozen_groups[index - n]


def shard_at(engine, index: int):
    """The optimizer shard of group ``index``, or None for a frozen group (it has none)."""
    return engine.shards[index] if index < len(engine.shards) else None
