"""The forward pass the planner traces: a causal language model's loss on one micro-batch of
token ids. The accuracy benchmark runs the same function on real tensors, so predicted and
measured steps are the same computation."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn


def vocab_size(module: nn.Module) -> int:
    """The vocabulary: from a Hugging Face config, else the first embedding's rows."""
    cfg = getattr(module, "config", None)
    if cfg is not None and getattr(cfg, "vocab_size", None):
        return int(cfg.vocab_size)
    for m in module.modules():
        if isinstance(m, nn.Embedding):
            return m.num_embeddings
    raise ValueError("zerocore estimate: cannot tell the model's vocabulary (no config.vocab_size, no nn.Embedding); "
                     "pass forward=... building the loss from the module yourself")


def is_hf(module: nn.Module) -> bool:
    return hasattr(module, "config") and hasattr(module, "can_generate") or type(module).__module__.startswith(
        "transformers.")


def lm_loss(module: nn.Module, batch: int, seq: int, device: torch.device, vocab: int | None = None,
            generator: torch.Generator | None = None, autocast: tuple | None = None) -> torch.Tensor:
    """Next-token cross-entropy of ``module`` on a (batch, seq) micro-batch of random token ids,
    made here (inside whatever tracker is running). ``autocast``: (device type, dtype) the module's call
    runs under, as the engine's forward runs it with ``torch_autocast`` (runtime/forward_autocast.py);
    a Transformers model's loss is inside that call, a plain module's is computed after it."""
    v = vocab or vocab_size(module)
    ids = torch.randint(0, v, (batch, seq), device=device, generator=generator)
    with torch.autocast(autocast[0], dtype=autocast[1]) if autocast else contextlib.nullcontext():
        if is_hf(module):
            return module(input_ids=ids, labels=ids).loss
        logits = module(ids)
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def enable_checkpointing(module: nn.Module) -> nn.Module:
    """Activation checkpointing of every block: Hugging Face's own switch, else each module held
    in a ModuleList re-runs its forward in backward (torch.utils.checkpoint, non-reentrant)."""
    if hasattr(module, "gradient_checkpointing_enable"):
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return module
    from torch.utils.checkpoint import checkpoint

    for lst in module.modules():
        if isinstance(lst, nn.ModuleList):
            for block in lst:
                plain = block.forward
                block.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(plain)
    return module
