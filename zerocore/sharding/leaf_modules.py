"""Leaf modules (DeepSpeed's "ZeRO-3 leaf modules"): modules stage 3 never splits into smaller units, so
a leaf's parameters are gathered together, by the leaf's own unit or by the unit holding it.

Why: in a mixture-of-experts block which experts run changes from step to step and from rank to rank.
Were each expert a unit of its own, the ranks would issue different gathers (a hang, or the divergence
check's error); DeepSpeed has the same problem with its per-module hooks and the same answer. zerocore's
units already gather a whole module (a decoder layer holding an MoE block is one unit), so a leaf only
tells the unit planner (``units.choose_unit_modules``) not to look inside: a leaf is a unit when it is
large enough (``stage3_unit_min_params``) and has a forward of its own, else it stays in its parent's unit;
no module inside it is a unit, whatever ``stage3_unit_classes`` names.

Which modules are leaves: those carrying DeepSpeed's flag (``module._z3_leaf = True``, set by
``deepspeed.utils.set_z3_leaf_modules``, which Accelerate calls for ``transformer_moe_cls_names`` and
which ``zerocore.deepspeed.utils`` provides over this module), and those the config's
``zero_optimization.leaf_module`` matches (classes, module names, name suffixes; DeepSpeed's defaults: the
sparse MoE blocks of Transformers' Mixtral, Qwen2-MoE and Qwen3-MoE). Matching by the config does not
change the model; ``zerocore.deepspeed.initialize`` also sets the flags, as DeepSpeed's engine does."""
from __future__ import annotations

import logging
from collections.abc import Iterable

from torch import nn

from ..config.schema import DEFAULT_LEAF_CLASSES

FLAG = "_z3_leaf"  # DeepSpeed's attribute: a model flagged for DeepSpeed plans the same units here

# DeepSpeed's defaults of zero_optimization.leaf_module (a section that names nothing else warns of no miss)
DEFAULT_CLASSES = DEFAULT_LEAF_CLASSES
DEFAULT_NAMES: list[str] = []
DEFAULT_NAME_SUFFIXES: list[str] = []

log = logging.getLogger("zerocore")


def is_leaf(module: nn.Module) -> bool:
    return bool(getattr(module, FLAG, False))


def qualified_class_name(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _class_matches(module: nn.Module, wanted) -> bool:
    """``wanted``: a class (instances of it and of its subclasses) or a class name (the class's own name or
    its module-qualified name)."""
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    return type(module).__name__ == wanted or qualified_class_name(module) == wanted


def by_class(model: nn.Module, classes: Iterable) -> list[nn.Module]:
    """Every module of ``model`` (itself included) matching one of ``classes``, in ``model.modules()`` order."""
    classes = list(classes)
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf module classes must be classes or class names (strings); got {bad[0]!r}")
    return [m for m in model.modules() if any(_class_matches(m, c) for c in classes)]


def by_name(model: nn.Module, names: Iterable[str]) -> tuple[list[nn.Module], list[str]]:
    """(the modules named so in ``model.named_modules()``, the names that match none)."""
    modules = dict(model.named_modules())
    found, missing = [], []
    for name in names:
        (found.append(modules[name]) if name in modules else missing.append(name))
    return found, missing


def by_suffix(model: nn.Module, suffixes: Iterable[str]) -> tuple[list[nn.Module], list[str]]:
    """(the modules whose ``named_modules()`` name ends with one of ``suffixes``, each once; the suffixes
    that match none)."""
    named = list(model.named_modules())
    found, seen, missing = [], set(), []
    for suffix in suffixes:
        hits = [m for n, m in named if n.endswith(suffix)]
        if not hits:
            missing.append(suffix)
        for m in hits:
            if id(m) not in seen:
                seen.add(id(m))
                found.append(m)
    return found, missing


def configured(model: nn.Module, cfg) -> list[nn.Module]:
    """The modules ``cfg`` (a ``zero_optimization.leaf_module`` section, or None) names, each once. Names and
    suffixes that match nothing, and a customised section that matches no module, are logged as warnings (as
    DeepSpeed does); the defaults matching nothing (a model without those MoE blocks) are not."""
    if cfg is None:
        return []
    found = by_class(model, cfg.classes)
    names, missing_names = by_name(model, cfg.names)
    suffixed, missing_suffixes = by_suffix(model, cfg.name_suffixes)
    if missing_names and list(cfg.names) != DEFAULT_NAMES:
        log.warning("zero_optimization.leaf_module.names: no module named %s in the model", missing_names)
    if missing_suffixes and list(cfg.name_suffixes) != DEFAULT_NAME_SUFFIXES:
        log.warning("zero_optimization.leaf_module.name_suffixes: no module name ends with %s", missing_suffixes)
    out, seen = [], set()
    for m in found + names + suffixed:
        if id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    customised = (list(cfg.classes) != DEFAULT_CLASSES or list(cfg.names) != DEFAULT_NAMES
                  or list(cfg.name_suffixes) != DEFAULT_NAME_SUFFIXES)
    if not out and customised:
        log.warning("zero_optimization.leaf_module matched no module of the model: units are chosen as without it")
    return out


def leaf_ids(model: nn.Module, cfg=None) -> set[int]:
    """ids of the leaf modules of ``model``: flagged, or named by ``cfg`` (see ``configured``)."""
    return {id(m) for m in model.modules() if is_leaf(m)} | {id(m) for m in configured(model, cfg)}
