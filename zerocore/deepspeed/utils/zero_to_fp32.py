"""``deepspeed.utils.zero_to_fp32`` for zerocore checkpoints: the full fp32 weights from a
checkpoint saved by ``engine.save_checkpoint`` (any world size or stage), in one process.

``checkpoint_dir`` is the directory given to ``save_checkpoint`` (the one holding ``latest`` and
the tag folders); ``tag`` picks a tag, else ``latest`` names it."""
from __future__ import annotations

import os

import torch

from ...checkpoint.offline import consolidate, load_full_state_dict


def _drop_frozen(state: dict, checkpoint_dir, tag) -> dict:
    from ...checkpoint.layout import locate, read_manifest

    manifest = read_manifest(locate(os.fspath(checkpoint_dir), tag))
    frozen = {a for e in manifest["extras"] if e["kind"] == "frozen" for a in e["aliases"]}
    return {k: v for k, v in state.items() if k not in frozen}


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The model's state dict in fp32 (from the fp32 master; buffers and frozen parameters too),
    under the model's own names. Holds the whole model in memory (``lazy_mode`` is accepted and
    loads eagerly)."""
    state = load_full_state_dict(checkpoint_dir, tag)
    return _drop_frozen(state, checkpoint_dir, tag) if exclude_frozen_parameters else state


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization: bool = False, tag=None,
                                               exclude_frozen_parameters: bool = False) -> list[str]:
    """Writes the fp32 weights into ``output_dir``: ``model.safetensors`` (sharded by
    ``max_shard_size`` into ``model-0000i-of-0000n.safetensors`` + an index, streaming) with
    ``safe_serialization``, else ``pytorch_model.bin`` (one file, through memory). Returns the
    files written."""
    os.makedirs(output_dir, exist_ok=True)
    if safe_serialization and not exclude_frozen_parameters:
        return consolidate(checkpoint_dir, os.path.join(output_dir, "model.safetensors"), tag=tag,
                           max_shard_size=max_shard_size)
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    if safe_serialization:
        from safetensors.torch import save_file

        out = os.path.join(output_dir, "model.safetensors")
        seen, unique = set(), {}
        for k, v in state.items():  # safetensors refuses shared storage: a tied weight once
            if id(v) not in seen:
                seen.add(id(v))
                unique[k] = v.contiguous()
        save_file(unique, out, metadata={"format": "pt"})
        return [out]
    out = os.path.join(output_dir, "pytorch_model.bin")
    torch.save(state, out)
    return [out]


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir, tag=None) -> torch.nn.Module:
    """Moves ``model`` to CPU and loads the checkpoint's fp32 weights into it (not strict, as
    DeepSpeed's). Returns the model."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
           "load_state_dict_from_zero_checkpoint"]
