"""Which buffers stay fp32 while the model trains in bf16/fp16: ``data_types.keep_in_fp32_modules``,
read as DeepSpeed 0.19.8 reads it, for the engine (``buffer_dtypes.py``) and for the DeepSpeed face's
``zero.Init`` (which builds every floating buffer in its dtype and turns these back to fp32).

A model may need some buffers in fp32: an MoE routing bias (``e_score_correction_bias``) whose
values sit close together loses the differences between experts in bf16. The setting is:

* ``"auto"``: the names a Transformers model gives in two class attributes,
  ``_keep_in_fp32_modules_strict`` (under bf16 and fp16) and ``_keep_in_fp32_modules`` (under fp16
  only), searched for in the buffer's name below the module that names them;
* a list of patterns, searched for anywhere in the buffer's full name;
* ``[]``: none.

Patterns are regular expressions but for ``*``, which stands for any characters (Transformers'
reading; DeepSpeed's too). Parameters are not touched: they train in the training dtype.
"""
from __future__ import annotations

import re

import torch
from torch import nn

AUTO = "auto"


def fp32_names_pattern(module: nn.Module, dtype: torch.dtype, setting=AUTO) -> re.Pattern | None:
    """The names (relative to ``module``) of the buffers to keep in fp32 under ``dtype``, as one
    pattern; None when there are none (and always under fp32)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    alternatives = set()
    if setting == AUTO:
        for prefix, sub in module.named_modules():
            names = set(getattr(sub, "_keep_in_fp32_modules_strict", None) or ())
            if dtype == torch.float16:
                names |= set(getattr(sub, "_keep_in_fp32_modules", None) or ())
            for name in names:
                wanted = name.replace("*", ".*")
                alternatives.add(rf"^{re.escape(prefix)}\..*{wanted}" if prefix else wanted)
    else:
        alternatives = {name.replace("*", ".*") for name in setting}
    return re.compile("|".join(sorted(alternatives))) if alternatives else None


def named_floating_buffers(module: nn.Module):
    """(owner, key in its ``_buffers``, full name) of every floating buffer, per owner: a buffer
    shared under two names appears under both."""
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for key, buf in owner._buffers.items():
            if buf is not None and buf.is_floating_point():
                yield owner, key, f"{prefix}.{key}" if prefix else key


def keep_named_buffers_in_fp32(module: nn.Module, dtype: torch.dtype, setting=AUTO) -> int:
    """Converts the floating buffers of ``module`` that ``setting`` names to fp32 in place (the module
    keeps the same tensor objects); returns how many were converted."""
    pattern = fp32_names_pattern(module, dtype, setting)
    if pattern is None:
        return 0
    converted = 0
    for owner, key, full in named_floating_buffers(module):
        buf = owner._buffers[key]
        if buf.dtype != torch.float32 and pattern.search(full):
            buf.data = buf.data.float()
            converted += 1
    return converted
