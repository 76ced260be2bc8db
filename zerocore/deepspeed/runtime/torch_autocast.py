"""``deepspeed.runtime.torch_autocast``: the names scripts read about the ``torch_autocast`` section.

zerocore's engine runs its forward under ``torch.autocast`` when the section is enabled
(``zerocore/runtime/forward_autocast.py``) and communicates every parameter and gradient in the training dtype:
no parameter carries a lower communication dtype, so ``get_comm_dtype(p)`` is ``p.dtype`` and
``has_comm_dtype(p)`` is false (DeepSpeed tags Linear and Conv parameters with the autocast dtype and reduces them
in it)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch

LOWER_PRECISION_SAFE_MODULES = [torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d]
PARAM_COMM_DTYPE_ATTR_NAME = "comm_dtype"


def get_default_autocast_lower_precision_modules() -> list[str]:
    return [f"{c.__module__}.{c.__name__}" for c in LOWER_PRECISION_SAFE_MODULES]


def has_comm_dtype(param: torch.nn.Parameter) -> bool:
    return hasattr(param, PARAM_COMM_DTYPE_ATTR_NAME)


def get_comm_dtype(param: torch.nn.Parameter) -> torch.dtype:
    return getattr(param, PARAM_COMM_DTYPE_ATTR_NAME, param.dtype)


def get_all_comm_dtypes(params: Iterable) -> set:
    return {get_comm_dtype(p) for p in params}


def sort_dtypes(dtypes: list) -> list:
    return sorted(dtypes, key=str)


@contextlib.contextmanager
def autocast_if_enabled(engine):
    """The engine's own forward context, for code that runs the module outside ``engine(...)``: its autocast
    when the section is enabled, else nothing (an autocast the caller opened stays in force)."""
    if engine.torch_autocast_enabled():
        with torch.autocast(engine.device.type, dtype=engine.torch_autocast_dtype()):
            yield
    else:
        yield
