"""The optimizer state of the owned range of one flat group: fp32 master, m and v.

With 16-bit training the master is a separate fp32 tensor and the Adam kernel writes the
16-bit parameters in the same pass (``param_out``); with fp32 training the master *is* the
owned slice of the parameters (no copy).
"""
from __future__ import annotations

import dataclasses

import torch

from .. import ops
from .group import ShardedGroup


@dataclasses.dataclass
class AdamHyper:
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    decoupled: bool  # AdamW


class OptimizerShard:
    def __init__(self, group: ShardedGroup, init_fp32: torch.Tensor):
        """``init_fp32``: the group's full initial parameters in fp32 (only the owned range is kept)."""
        self.group = group
        lo, hi = group.lo, group.hi
        if group.layout.dtype == torch.float32:
            self.master = group.param_flat[lo:hi]
            self.param_out = None
        else:
            self.master = init_fp32[lo:hi].clone()
            self.param_out = group.param_flat[lo:hi]
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)

    def step(self, grad: torch.Tensor, hp: AdamHyper, *, step: int, grad_scale: float) -> None:
        ops.adam_step(self.master, grad, self.exp_avg, self.exp_avg_sq, lr=hp.lr, betas=hp.betas, eps=hp.eps,
                      weight_decay=hp.weight_decay, step=step, adamw_mode=hp.decoupled, grad_scale=grad_scale,
                      param_out=self.param_out)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
