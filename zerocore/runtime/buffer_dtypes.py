"""The dtype each floating buffer trains in under bf16/fp16, from ``data_types.buffer_dtype``:
a dtype casts them to it; ``"keep"`` leaves each in the dtype it had at initialize (an fp32 rotary
``inv_freq`` stays fp32: rounding it to bf16 changes every position's angle), DeepSpeed 0.19.8's
rule for null (torch AMP and FSDP2 keep buffers too), which ``zerocore.deepspeed.initialize``
follows (``deepspeed/semantics.py``); null, for ``zerocore.initialize``: the training dtype, since
BatchNorm's CPU and CUDA kernels refuse bf16/fp16 weights beside fp32 running statistics (a
BatchNorm model does not run under DeepSpeed's rule). Whatever it says, the buffers
``data_types.keep_in_fp32_modules`` names become fp32. Under fp32 training every floating buffer
becomes fp32 (zerocore upcasts a 16-bit model's parameters then, and its buffers with them;
DeepSpeed refuses such a model). Parameters are not this file's: they train in the training dtype.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config.schema import KEEP
from .keep_in_fp32 import fp32_names_pattern, named_floating_buffers

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def buffer_targets(module: nn.Module, data_types, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.dtype]]:
    """(buffer, dtype to convert it to) for every floating buffer of ``module`` that changes dtype;
    ``data_types`` is the config's section, ``dtype`` the training dtype. A buffer shared under
    several names is listed once, kept in fp32 if any of its names is."""
    if dtype == torch.float32:
        cast, keep = torch.float32, None
    else:
        asked = data_types.buffer_dtype
        cast = dtype if asked is None else None if asked == KEEP else DTYPES[asked]
        keep = fp32_names_pattern(module, dtype, data_types.keep_in_fp32_modules)
    wanted: dict[int, tuple[torch.Tensor, torch.dtype | None]] = {}
    for owner, key, full in named_floating_buffers(module):
        buf = owner._buffers[key]
        if keep is not None and keep.search(full):
            wanted[id(buf)] = (buf, torch.float32)
        else:
            wanted.setdefault(id(buf), (buf, cast))
    return [(buf, want) for buf, want in wanted.values() if want is not None and buf.dtype != want]
