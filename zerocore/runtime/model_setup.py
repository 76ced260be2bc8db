"""What the engine needs to know about a model before sharding it: parameter names (tied
weights have several), which parameters train, and converting the parameters kept whole to the
training dtype and the buffers to theirs (``buffer_dtypes.py``), as DeepSpeed does (callers feed
inputs of the training dtype)."""
from __future__ import annotations

import torch

from ..comm import Comm
from ..config import ZeroConfig
from .buffer_dtypes import buffer_targets
from .partition_init import gather_full


def training_dtype(cfg: ZeroConfig) -> torch.dtype:
    if cfg.bf16.enabled:
        return torch.bfloat16
    if cfg.fp16.enabled:
        return torch.float16
    return torch.float32


def accumulation_dtype(cfg: ZeroConfig) -> torch.dtype | None:
    """The dtype of stages 0/1's full gradient buffer where it is not the training dtype: fp32 for bf16 training at
    stage 1 without optimizer offload when ``data_types.grad_accum_dtype`` says "fp32" (DeepSpeed's BF16 optimizer);
    None elsewhere (the training dtype: DeepSpeed's ZeRO optimizer accumulates in it whatever the key says)."""
    z = cfg.zero_optimization
    if (cfg.data_types.grad_accum_dtype == "fp32" and cfg.bf16.enabled and z.stage == 1
            and z.offload_optimizer.device == "none"):
        return torch.float32
    return None


def all_named_params(module: torch.nn.Module) -> list[tuple[tuple[str, ...], torch.nn.Parameter]]:
    """Every parameter as (all names, parameter) in registration order; a parameter shared by several
    modules appears once with every name."""
    names: dict[int, list[str]] = {}
    params: dict[int, torch.nn.Parameter] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    return [(tuple(names[key]), p) for key, p in params.items()]


def named_params(module: torch.nn.Module) -> tuple[list[tuple[tuple[str, ...], torch.nn.Parameter]],
                                                   list[tuple[tuple[str, ...], torch.nn.Parameter]]]:
    """(trainable, frozen) of ``all_named_params``."""
    trainable, frozen = [], []
    for ns, p in all_named_params(module):
        (trainable if p.requires_grad else frozen).append((ns, p))
    for ns, p in trainable:
        if not p.is_floating_point():
            raise TypeError(f"zerocore: trainable parameter '{ns[0]}' has dtype {p.dtype}; only floating point "
                            "parameters can be trained")
    return trainable, frozen


def convert_rest(module: torch.nn.Module, frozen, dtype: torch.dtype, comm: Comm, data_types) -> None:
    """Frozen parameters kept whole (every frozen one below stage 3; at stage 3 the persistent and
    non-floating ones: ``frozen_groups.py`` partitions the others) to ``dtype``, floating buffers to
    the dtype ``data_types`` (the config's section) gives them (``buffer_dtypes.py``); all synced
    from rank 0 (as DDP does)."""
    for _, p in frozen:
        if hasattr(p, "_zc_init"):  # partitioned by zerocore.init: made whole again
            p.data = gather_full(p, comm).clone()
            del p._zc_init
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
        comm.broadcast(p.data)
    for buf, want in buffer_targets(module, data_types, dtype):
        buf.data = buf.data.to(want)  # in place: a buffer shared by several modules stays shared
    for b in module.buffers():
        comm.broadcast(b)
