"""``deepspeed.runtime.zero.leaf_module_config``: the defaults of ``zero_optimization.leaf_module`` and the
section as an object (zerocore's schema: ``zerocore.config.schema.LeafModuleConfig``)."""
from __future__ import annotations

from ....config import load_config
from ....config.schema import DEFAULT_LEAF_CLASSES

DEFAULT_LEAF_MODULE_CLASSES: list[str] = list(DEFAULT_LEAF_CLASSES)
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []


def DeepSpeedZeroLeafModuleConfig(**section):  # noqa: N802 - DeepSpeed's class name
    """``DeepSpeedZeroLeafModuleConfig(classes=..., names=..., name_suffixes=...)``: the section, validated (a
    string is a list of one, each entry kept once)."""
    return load_config({"zero_optimization": {"stage": 3, "leaf_module": section}}).zero_optimization.leaf_module
