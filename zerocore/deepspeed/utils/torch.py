"""``deepspeed.utils.torch.required_torch_version``: whether the running torch is in a range."""
from __future__ import annotations

import torch as _torch
# torch's own version type (it compares with version strings through the packaging copy torch vendors):
# ``packaging`` itself is not one of zerocore's requirements, and DeepSpeed, which brings it, may be absent
from torch.torch_version import TorchVersion as _TorchVersion


def required_torch_version(min_version=None, max_version=None) -> bool:
    """True when ``min_version <= torch's major.minor <= max_version`` (either bound may be None)."""
    here = _TorchVersion(".".join(_torch.__version__.split("+")[0].split(".")[:2]))
    if min_version is not None and here < str(min_version):
        return False
    if max_version is not None and here > str(max_version):
        return False
    return True
