"""``deepspeed.utils``' ZeRO-3 leaf-module functions: they set and read DeepSpeed's flag (``module._z3_leaf``),
which zerocore's stage 3 reads when it chooses its units (``zerocore.sharding.leaf_modules``): no unit inside a
leaf, so an MoE block whose experts run differently on each rank is gathered whole. Accelerate calls
``set_z3_leaf_modules`` for ``transformer_moe_cls_names``. Same signatures, returns and errors as DeepSpeed's."""
from __future__ import annotations

from torch import nn

from ...sharding import leaf_modules as _leaf

__all__ = ["z3_leaf_module", "z3_leaf_parameter", "get_z3_leaf_modules", "set_z3_leaf_module", "set_z3_leaf_modules",
           "unset_z3_leaf_modules", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix",
           "apply_zero_leaf_module_config"]


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether ``model`` is flagged as a leaf module."""
    return _leaf.is_leaf(model)


def z3_leaf_parameter(param) -> bool:
    """Whether ``param`` is marked as belonging to a leaf module (DeepSpeed's ``ds_z3_leaf_module``
    attribute; zerocore does not set it: its units, not its parameters, know the leaves)."""
    return hasattr(param, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` (itself included) flagged as leaves."""
    return [m for m in model.modules() if _leaf.is_leaf(m)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    setattr(model, _leaf.FLAG, flag)


def _flag_classes(model: nn.Module, leaf_module_classes, flag: bool, raise_if_not_found: bool) -> list[nn.Module]:
    classes = list(leaf_module_classes)
    if not all(isinstance(c, (type, str)) for c in classes):
        raise AssertionError(f"leaf_module_classes must be a list of types or names, got {leaf_module_classes}")
    found = _leaf.by_class(model, classes)
    for m in found:
        set_z3_leaf_module(m, flag)
    if not found and raise_if_not_found:
        raise ValueError(f"No modules of type {leaf_module_classes} found in model {model}")
    return found


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes, raise_if_not_found: bool = True) -> list[nn.Module]:
    """Flags every module of ``model`` that is an instance of one of ``leaf_module_classes`` (classes, or class
    names: a class's own or module-qualified name) as a leaf; returns them. ValueError when none matches and
    ``raise_if_not_found``."""
    return _flag_classes(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes, raise_if_not_found: bool = True) -> list[nn.Module]:
    """Clears the flag of the modules ``set_z3_leaf_modules`` would flag; returns them."""
    return _flag_classes(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model: nn.Module, module_names, flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Sets the flag of the modules named so in ``model.named_modules()``; returns (them, the names not found)."""
    return _flag_matches(*_leaf.by_name(model, module_names), flag, raise_if_not_found,
                         lambda missing: f"No modules named {missing} found in model {model}")


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes, flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Sets the flag of the modules whose name ends with one of the suffixes; returns (them, the suffixes that
    matched nothing)."""
    return _flag_matches(*_leaf.by_suffix(model, module_name_suffixes), flag, raise_if_not_found,
                         lambda missing: f"No modules matching suffixes {missing} found in model {model}")


def _flag_matches(found, missing, flag: bool, raise_if_not_found: bool, message):
    """Sets ``flag`` on ``found``; DeepSpeed's ValueError (``message(missing)``) where something matched nothing."""
    for m in found:
        set_z3_leaf_module(m, flag)
    if missing and raise_if_not_found:
        raise ValueError(message(missing))
    return found, missing


def apply_zero_leaf_module_config(model: nn.Module, leaf_cfg) -> list[nn.Module]:
    """Flags the modules a ``zero_optimization.leaf_module`` section names (None: nothing); returns them.
    ``deepspeed.initialize`` calls it, as DeepSpeed's engine does."""
    found = _leaf.configured(model, leaf_cfg)
    for m in found:
        set_z3_leaf_module(m, True)
    return found
