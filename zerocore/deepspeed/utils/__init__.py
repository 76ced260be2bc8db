"""``deepspeed.utils``: ``logger`` and ``log_dist``, the tensor-fragment functions (``safe_get_full_fp32_param``
and its siblings), ``zero_to_fp32`` over zerocore's checkpoint module, ``deepspeed.utils.torch`` (torch version
checks), the ZeRO-3 leaf-module functions (``z3_leaf_module``) and ``RepeatingLoader`` (runtime/dataloader.py)."""
from . import torch, z3_leaf_module as _z3_leaf_module_functions, zero_to_fp32  # noqa: F401
from .logging import log_dist, logger  # noqa: F401
from ..runtime.dataloader import RepeatingLoader  # noqa: F401
from . import tensor_fragment as _tensor_fragment_functions
from .tensor_fragment import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,  # noqa: F401
                              safe_get_local_fp32_param, safe_get_local_grad, safe_get_local_optimizer_state,
                              safe_set_full_fp32_param, safe_set_full_grad, safe_set_full_optimizer_state,
                              safe_set_local_fp32_param, safe_set_local_grad, safe_set_local_optimizer_state,
                              safe_update_full_grad_vectorized)
from .z3_leaf_module import (apply_zero_leaf_module_config, get_z3_leaf_modules, set_z3_leaf_module,  # noqa: F401
                             set_z3_leaf_modules, set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix,
                             unset_z3_leaf_modules, z3_leaf_module, z3_leaf_parameter)

__all__ = ["logger", "log_dist", "zero_to_fp32", "torch", "RepeatingLoader", *_tensor_fragment_functions.__all__,
           *_z3_leaf_module_functions.__all__]
