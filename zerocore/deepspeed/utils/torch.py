"""``deepspeed.utils.torch.required_torch_version``: whether the running torch is in a range."""
from __future__ import annotations

from packaging import version as _version
import torch as _torch


def required_torch_version(min_version=None, max_version=None) -> bool:
    """True when ``min_version <= torch's major.minor <= max_version`` (either bound may be None)."""
    here = _version.parse(".".join(_torch.__version__.split("+")[0].split(".")[:2]))
    if min_version is not None and here < _version.parse(str(min_version)):
        return False
    if max_version is not None and here > _version.parse(str(max_version)):
        return False
    return True
