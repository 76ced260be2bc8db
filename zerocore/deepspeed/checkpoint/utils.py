"""``deepspeed.checkpoint.utils``: ``clone_tensors_for_torch_save`` and DeepSpeed's file names."""
from __future__ import annotations

import os

import torch


def clone_tensors_for_torch_save(item, device=torch.device("cpu")):
    """``item`` with every tensor in it (nested in lists, tuples and dicts) replaced by a copy of its
    own on ``device``: a view of a large flat buffer saved by ``torch.save`` would write the whole
    buffer; the copy holds just its elements."""
    if isinstance(item, torch.Tensor):
        device = torch.device(device)
        t = item.detach()
        return t.clone() if t.device == device else t.to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    return item


def get_model_ckpt_name_for_rank(base_folder, mp_rank_str: str) -> str:
    """The path DeepSpeed gives a model-parallel rank's model states in a tag folder. zerocore's
    checkpoints have no such file (a manifest and one file per rank: ``zerocore/checkpoint``): read
    them with ``deepspeed.utils.zero_to_fp32`` or ``zerocore.checkpoint``."""
    return os.path.join(base_folder, f"mp_rank_{mp_rank_str}_model_states.pt")
