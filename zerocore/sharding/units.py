"""Stage 3's units: which modules gather their parameters together, and which parameter goes where.

A *unit* is a module whose forward gathers one flat group (one collective per unit, not per
parameter), like a module wrapped with FSDP2's ``fully_shard``. The root module is always a
unit: it holds whatever no smaller unit takes. The others are chosen

- by class name (``stage3_unit_classes``, e.g. ``["Block"]``): every module of those classes; or
- by size (default): walking down from the root, a child with at least ``stage3_unit_min_params``
  trainable elements becomes a unit and is not split further, except containers without a
  forward of their own (ModuleList / ModuleDict) and children holding more than half of the
  model (a ``transformer`` wrapper around the blocks), which are walked into. For a transformer
  this yields one unit per block plus the embedding.

A parameter registered by several modules (an embedding tied to the output head) belongs to
the innermost unit that contains every module registering it (for tied embeddings: the root),
so it is gathered for every use. Parameters with fewer than
``stage3_param_persistence_threshold`` elements are *persistent*: never partitioned (kept whole on
every rank, their optimizer state still sharded), as DeepSpeed does, since gathering many tiny
tensors costs more in latency than it saves in memory.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch import nn

from .records import full_shape

Named = tuple[tuple[str, ...], nn.Parameter]


@dataclasses.dataclass
class UnitPlan:
    name: str  # module path; "" for the root
    module: nn.Module
    params: list[Named]  # trainable, partitioned, in registration order


def _size(module: nn.Module, trainable: set[int]) -> int:
    seen, n = set(), 0
    for p in module.parameters():
        if id(p) in trainable and id(p) not in seen:
            seen.add(id(p))
            n += logical_numel(p)
    return n


def logical_numel(p) -> int:
    """Elements of a parameter, also when construction-time partitioning left only a chunk."""
    return full_shape(p).numel()


def choose_unit_modules(root: nn.Module, trainable: set[int], *, classes: Sequence[str] = (),
                        min_params: int = 1) -> list[tuple[str, nn.Module]]:
    """(path, module) of every unit, root first, then in registration order."""
    if classes:
        wanted = set(classes)
        found = [(n, m) for n, m in root.named_modules() if n and type(m).__name__ in wanted]
        if not found and type(root).__name__ in wanted:
            return [("", root)]  # the root is always a unit: naming its class asks for just that
        if not found:
            present = sorted({type(m).__name__ for _, m in root.named_modules()})
            raise ValueError(f"zero_optimization.stage3_unit_classes: no module of class {sorted(wanted)} in the "
                             f"model; its module classes are {present}")
        # a unit inside another unit of a named class is still its own unit (nested units work)
        return [("", root)] + found
    total = _size(root, trainable)
    units: list[tuple[str, nn.Module]] = [("", root)]

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            size = _size(child, trainable)
            if size == 0:
                continue
            has_children = any(True for _ in child.children())
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)) or (size > total // 2 and has_children):
                visit(child, path + ".")
            elif size >= min_params:
                units.append((path, child))

    visit(root, "")
    return units


def plan_units(root: nn.Module, trainable: list[Named], *, classes: Sequence[str] = (), min_params: int = 1,
               persistence_threshold: int = 0) -> tuple[list[UnitPlan], list[Named]]:
    """Splits the trainable parameters into units and persistent ones.

    Returns (units with at least one parameter, root first; persistent parameters)."""
    ids = {id(p) for _, p in trainable}
    chosen = choose_unit_modules(root, ids, classes=classes, min_params=min_params)
    unit_paths = [path for path, _ in chosen]
    plans = [UnitPlan(path, m, []) for path, m in chosen]
    persistent: list[Named] = []
    for names, p in trainable:
        if logical_numel(p) < persistence_threshold:
            persistent.append((names, p))
            continue
        owners = [n.rsplit(".", 1)[0] if "." in n else "" for n in names]
        best = 0  # the root contains everything
        for i, path in enumerate(unit_paths):
            if i and all(_inside(o, path) for o in owners) and len(path) > len(unit_paths[best]):
                best = i
        plans[best].params.append((names, p))
    return [u for u in plans if u.params], persistent


def _inside(module_path: str, unit_path: str) -> bool:
    return module_path == unit_path or module_path.startswith(unit_path + ".")
