"""``deepspeed.utils``: ``logger`` and ``log_dist``, ``safe_get_full_grad``, ``zero_to_fp32`` over
zerocore's checkpoint module, ``deepspeed.utils.torch`` (torch version checks) and the ZeRO-3 leaf-module
functions (``z3_leaf_module``)."""
from . import torch, z3_leaf_module as _z3_leaf_module_functions, zero_to_fp32  # noqa: F401
from .logging import log_dist, logger  # noqa: F401
from .tensor_fragment import safe_get_full_grad  # noqa: F401
from .z3_leaf_module import (apply_zero_leaf_module_config, get_z3_leaf_modules, set_z3_leaf_module,  # noqa: F401
                             set_z3_leaf_modules, set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix,
                             unset_z3_leaf_modules, z3_leaf_module, z3_leaf_parameter)

__all__ = ["logger", "log_dist", "safe_get_full_grad", "zero_to_fp32", "torch", *_z3_leaf_module_functions.__all__]
