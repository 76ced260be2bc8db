"""Stage 3's units: which modules gather their parameters together, and which parameter goes where.

A *unit* is a module whose forward gathers one flat group (one collective per unit, not per
parameter), like a module wrapped with FSDP2's ``fully_shard``. The root module is always a
unit: it holds whatever no smaller unit takes. The others are chosen

- by class name (``stage3_unit_classes``, e.g. ``["Block"]``): every module of those classes; or
- by size (default): walking down from the root, a child with at least ``stage3_unit_min_params``
  elements to gather becomes a unit and is not split further, except containers without a
  forward of their own (ModuleList / ModuleDict) and children holding more than half of the
  model (a ``transformer`` wrapper around the blocks), which are walked into. For a transformer
  this yields one unit per block plus the embedding.

Either way no unit is chosen inside a *leaf module* (``leaf_modules``: DeepSpeed's
``set_z3_leaf_modules`` flag, or ``zero_optimization.leaf_module``): an MoE block whose experts run
differently on each rank is gathered whole.

A parameter registered by several modules (an embedding tied to the output head) belongs to
the innermost unit that contains every module registering it (for tied embeddings: the root),
so it is gathered for every use. Parameters with fewer than
``stage3_param_persistence_threshold`` elements are *persistent*: never partitioned (kept whole on
every rank, their optimizer state still sharded), as DeepSpeed does, since gathering many tiny
tensors costs more in latency than it saves in memory.

Frozen parameters (``requires_grad=False``) are placed by the same rules and gathered with their
unit (DeepSpeed partitions every parameter, frozen or not): a LoRA model's frozen base is what
stage 3 must shard. Unit sizes count them, so a module holding only frozen weights (a frozen
embedding) is a unit of its own. Frozen parameters that are not floating point (a flat group has
one dtype) or are persistent stay whole on every rank.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence, Set

from torch import nn

from .records import full_shape

Named = tuple[tuple[str, ...], nn.Parameter]


@dataclasses.dataclass
class UnitPlan:
    name: str  # module path; "" for the root
    module: nn.Module
    params: list[Named]  # trainable, partitioned, in registration order
    frozen: list[Named] = dataclasses.field(default_factory=list)  # frozen, partitioned, gathered with the unit


def _size(module: nn.Module, counted: set[int]) -> int:
    seen, n = set(), 0
    for p in module.parameters():
        if id(p) in counted and id(p) not in seen:
            seen.add(id(p))
            n += logical_numel(p)
    return n


def logical_numel(p) -> int:
    """Elements of a parameter, also when construction-time partitioning left only a chunk."""
    return full_shape(p).numel()


def choose_unit_modules(root: nn.Module, trainable: set[int], *, classes: Sequence[str] = (),
                        min_params: int = 1, leaves: Set[int] = frozenset()) -> list[tuple[str, nn.Module]]:
    """(path, module) of every unit, root first, then in registration order. ``trainable``: ids of
    the parameters whose elements the sizes count (the ones to gather, frozen ones included).
    ``leaves``: ids of the leaf modules (``leaf_modules``): no unit is chosen inside one."""
    if classes:
        wanted = set(classes)
        found = [(n, m) for n, m in root.named_modules() if n and type(m).__name__ in wanted]
        if not found and type(root).__name__ not in wanted:
            present = sorted({type(m).__name__ for _, m in root.named_modules()})
            raise ValueError(f"zero_optimization.stage3_unit_classes: no module of class {sorted(wanted)} in the "
                             f"model; its module classes are {present}")
        # the root is always a unit (naming its class asks for just that); a unit inside another unit of a
        # named class is still its own unit (nested units work), one inside a leaf module is not
        if id(root) in leaves:
            return [("", root)]
        inside_leaf = _inside_leaves(root, leaves)
        return [("", root)] + [(n, m) for n, m in found if n not in inside_leaf]
    if id(root) in leaves:
        return [("", root)]
    total = _size(root, trainable)
    units: list[tuple[str, nn.Module]] = [("", root)]

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            size = _size(child, trainable)
            if size == 0:
                continue
            has_children = any(True for _ in child.children())
            container = isinstance(child, (nn.ModuleList, nn.ModuleDict))
            if id(child) in leaves:  # not split; a unit if it runs a forward of its own, else its parent's
                if not container and size >= min_params:
                    units.append((path, child))
            elif container or (size > total // 2 and has_children):
                visit(child, path + ".")
            elif size >= min_params:
                units.append((path, child))

    visit(root, "")
    return units


def plan_units(root: nn.Module, trainable: list[Named], *, frozen: Sequence[Named] = (), classes: Sequence[str] = (),
               min_params: int = 1, persistence_threshold: int = 0,
               leaves: Set[int] = frozenset(), persistent_ids: Set[int] = frozenset()
               ) -> tuple[list[UnitPlan], list[Named]]:
    """Splits the trainable parameters into units and persistent ones (under ``persistence_threshold``
    elements, or named in ``persistent_ids``), and places the partitioned frozen ones (``frozen``:
    floating point, at least ``persistence_threshold`` elements, not named: see ``partitioned_frozen``)
    in the units' ``frozen`` lists.

    Returns (units with at least one parameter, root first; persistent trainable parameters)."""
    frozen = list(frozen)
    ids = {id(p) for _, p in trainable} | {id(p) for _, p in frozen}
    chosen = choose_unit_modules(root, ids, classes=classes, min_params=min_params, leaves=leaves)
    unit_paths = [path for path, _ in chosen]
    plans = [UnitPlan(path, m, []) for path, m in chosen]

    def owner(names) -> UnitPlan:
        owners = [n.rsplit(".", 1)[0] if "." in n else "" for n in names]
        best = 0  # the root contains everything
        for i, path in enumerate(unit_paths):
            if i and all(_inside(o, path) for o in owners) and len(path) > len(unit_paths[best]):
                best = i
        return plans[best]

    persistent: list[Named] = []
    for names, p in trainable:
        if logical_numel(p) < persistence_threshold or id(p) in persistent_ids:
            persistent.append((names, p))
        else:
            owner(names).params.append((names, p))
    for names, p in frozen:
        owner(names).frozen.append((names, p))
    return [u for u in plans if u.params or u.frozen], persistent


def partitioned_frozen(frozen: Sequence[Named], persistence_threshold: int,
                       persistent_ids: Set[int] = frozenset()) -> list[Named]:
    """The frozen parameters stage 3 partitions: floating point (a flat group holds one dtype) and
    not persistent (below ``stage3_param_persistence_threshold`` elements, or named in
    ``persistent_ids``, they stay whole, as persistent trainable ones do)."""
    return [(n, p) for n, p in frozen
            if p.is_floating_point() and logical_numel(p) >= persistence_threshold and id(p) not in persistent_ids]


def _inside_leaves(root: nn.Module, leaves: Set[int]) -> set[str]:
    """Paths of the modules strictly inside a leaf module of ``root``."""
    if not leaves:
        return set()
    named = list(root.named_modules())
    leaf_paths = [n for n, m in named if n and id(m) in leaves]
    return {n for n, _ in named if any(n.startswith(lp + ".") for lp in leaf_paths)}


def _inside(module_path: str, unit_path: str) -> bool:
    return module_path == unit_path or module_path.startswith(unit_path + ".")


def entry_modules(root: nn.Module, unit_modules: Sequence[nn.Module], sizes: dict[int, int]) -> list[nn.Module]:
    """The wrappers a forward may enter below the root: from the root down, each child holding more
    than half of the elements to gather (``sizes``: id(parameter) -> elements), until a unit or a
    container without a forward of its own. PEFT's ``PeftModel`` -> ``LoraModel`` ->
    ``LlamaForCausalLM`` -> ``LlamaModel``, say: generation calls ``LlamaForCausalLM``'s forward."""
    units = {id(m) for m in unit_modules}
    total = sum(sizes.values())
    out, m = [], root
    while True:
        nxt = None
        for child in m.children():
            seen, n = set(), 0
            for p in child.parameters():
                if id(p) in sizes and id(p) not in seen:
                    seen.add(id(p))
                    n += sizes[id(p)]
            if 2 * n > total:
                nxt = child
                break
        if nxt is None or id(nxt) in units or isinstance(nxt, (nn.ModuleList, nn.ModuleDict)):
            return out
        out.append(nxt)
        m = nxt

