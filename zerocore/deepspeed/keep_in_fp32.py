"""Buffers a Transformers model names for fp32 go back to fp32 after ``zero.Init`` built them in bf16/fp16,
as DeepSpeed 0.19.8's Init does (its ``data_types.keep_in_fp32_modules: "auto"``, the default).

Init's constructor overrides (tensor_overrides.py) make every floating buffer in Init's dtype, but a
model may need some in fp32: an MoE routing bias (``e_score_correction_bias``) whose values sit close
together loses the differences between experts in bf16. Transformers names them in two class
attributes, ``_keep_in_fp32_modules_strict`` (under bf16 and fp16) and ``_keep_in_fp32_modules``
(under fp16 only), as patterns (``*`` any characters) searched for in the buffer's name below the
module that names them. Parameters are not touched: they train in Init's dtype.
"""
from __future__ import annotations

import re

import torch
from torch import nn


def fp32_names_pattern(module: nn.Module, dtype: torch.dtype) -> re.Pattern | None:
    """The names (relative to ``module``) of the buffers to keep in fp32 under ``dtype``, as one
    pattern; None when there are none (and always under fp32)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    alternatives = set()
    for prefix, sub in module.named_modules():
        names = set(getattr(sub, "_keep_in_fp32_modules_strict", None) or ())
        if dtype == torch.float16:
            names |= set(getattr(sub, "_keep_in_fp32_modules", None) or ())
        for name in names:
            # the names are regular expressions but for "*" (Transformers' reading; DeepSpeed's too)
            wanted = name.replace("*", ".*")
            alternatives.add(rf"^{re.escape(prefix)}\..*{wanted}" if prefix else wanted)
    return re.compile("|".join(sorted(alternatives))) if alternatives else None


def keep_named_buffers_in_fp32(module: nn.Module, dtype: torch.dtype) -> int:
    """Converts the floating buffers of ``module`` its Transformers lists name to fp32 in place (the
    module keeps the same tensor objects); returns how many were converted."""
    pattern = fp32_names_pattern(module, dtype)
    if pattern is None:
        return 0
    converted = 0
    for prefix, owner in module.named_modules():
        # each owner's own buffers: a buffer shared under two names is kept if either name matches
        for name, buf in owner.named_buffers(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            if buf is not None and buf.is_floating_point() and buf.dtype != torch.float32 and pattern.search(full):
                buf.data = buf.data.float()
                converted += 1
    return converted
