"""The dtype each floating buffer trains in under bf16/fp16, from ``data_types.buffer_dtype``:
a dtype casts them to it; ``"keep"`` leaves each in the dtype it had at initialize (an fp32 rotary
``inv_freq`` stays fp32: rounded to bf16, a frequency is off by up to 0.2%, and the angle between
two tokens 4096 apart by up to tenths of a radian), DeepSpeed 0.19.8's rule for null (torch AMP and
FSDP2 keep buffers too), which ``zerocore.deepspeed.initialize`` follows (``deepspeed/semantics.py``). Null, for
``zerocore.initialize``: the buffers of a Transformers model (every module inside a
``transformers.PreTrainedModel``: its models are written for kept buffers, e.g. they compute rotary
angles in fp32 from an fp32 ``inv_freq``) as ``"keep"``; the other buffers take the training dtype,
since a custom model's fp32 buffer added to 16-bit activations makes them fp32 before its next
16-bit layer. Under ``"keep"`` (and so for Transformers models) the running statistics of a
normalization layer with 16-bit weights (BatchNorm, SyncBatchNorm, InstanceNorm tracking its
statistics) take the training dtype too: torch's CPU and CUDA kernels refuse bf16/fp16 weights beside
fp32 running statistics (DeepSpeed's engine fails at that layer's first forward). Whatever it says,
the buffers ``data_types.keep_in_fp32_modules`` names become fp32. Under fp32 training every floating
buffer becomes fp32 (zerocore upcasts a 16-bit model's parameters then, and its buffers with them;
DeepSpeed refuses such a model). Parameters are not this file's: they train in the training dtype.
"""
from __future__ import annotations

import sys

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from ..config.schema import KEEP
from .keep_in_fp32 import fp32_names_pattern, named_floating_buffers

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def buffer_targets(module: nn.Module, data_types, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.dtype]]:
    """(buffer, dtype to convert it to) for every floating buffer of ``module`` that changes dtype;
    ``data_types`` is the config's section, ``dtype`` the training dtype. A buffer shared under
    several names is listed once, kept in fp32 if any of its names is."""
    keep = kept_owners = None  # kept_owners: the modules whose buffers keep their dtype (None: all, under "keep")
    if dtype == torch.float32:
        cast = torch.float32
    else:
        asked = data_types.buffer_dtype
        cast = dtype if asked is None else None if asked == KEEP else DTYPES[asked]
        keep = fp32_names_pattern(module, dtype, data_types.keep_in_fp32_modules)
        kept_owners = _transformers_modules(module) if asked is None else None
    wanted: dict[int, tuple[torch.Tensor, torch.dtype | None]] = {}
    for owner, key, full in named_floating_buffers(module):
        buf = owner._buffers[key]
        if keep is not None and keep.search(full):
            wanted[id(buf)] = (buf, torch.float32)
            continue
        want = cast
        if want is None or kept_owners is not None and id(owner) in kept_owners:
            want = dtype if _norm_with_weights(owner) else None  # kept (the norm layers' kernels aside)
        wanted.setdefault(id(buf), (buf, want))
    return [(buf, want) for buf, want in wanted.values() if want is not None and buf.dtype != want]


def _transformers_modules(module: nn.Module) -> set[int]:
    """ids of the modules inside a Transformers model in ``module`` (``module`` itself if it is one);
    none where Transformers' model base is not imported (then no model of its exists; nothing is
    imported here)."""
    base = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    inside: set[int] = set()
    if base is None:
        return inside
    for sub in module.modules():
        if isinstance(sub, base) and id(sub) not in inside:
            inside.update(id(m) for m in sub.modules())
    return inside


def _norm_with_weights(owner: nn.Module) -> bool:
    """A normalization layer whose running statistics must share its (affine) weights' dtype."""
    weight = getattr(owner, "weight", None)
    return isinstance(owner, _NormBase) and isinstance(weight, nn.Parameter) and weight.is_floating_point()
