"""The optimizer state of the owned range of one flat group: fp32 master, m and v.

With 16-bit training the master is a separate fp32 tensor and the Adam kernel writes the
16-bit parameters in the same pass (``param_out``); with fp32 training the master *is* the
owned slice of the parameters (no copy).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator

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
    def __init__(self, group: ShardedGroup, init_fp32: torch.Tensor, *, tile: int | None = None):
        """``init_fp32``: the group's initial parameters in fp32, either full (only the owned range is
        kept) or just the owned range. ``tile``: at most this many elements per kernel call
        (``sub_group_size``; the unit NVMe offload will swap)."""
        self.group = group
        lo, hi = group.lo, group.hi
        owned = init_fp32 if init_fp32.numel() == hi - lo else init_fp32[lo:hi]
        if group.layout.dtype == torch.float32:
            self.master = group.owned_params()
            self.param_out = None
        else:
            self.master = owned.clone()
            self.param_out = group.owned_params()
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.tile = tile or self.master.numel() or 1

    def step(self, grad: torch.Tensor, hp: AdamHyper, *, step: int, grad_scale: float) -> None:
        n = self.master.numel()
        for a in range(0, n, self.tile):
            b = min(n, a + self.tile)
            ops.adam_step(self.master[a:b], grad[a:b], self.exp_avg[a:b], self.exp_avg_sq[a:b], lr=hp.lr,
                          betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay, step=step,
                          adamw_mode=hp.decoupled, grad_scale=grad_scale,
                          param_out=None if self.param_out is None else self.param_out[a:b])

    def state_tiles(self, max_elems: int, *, write: bool = False
                    ) -> Iterator[tuple[int, int, dict[str, torch.Tensor]]]:
        """The owned optimizer state in consecutive ranges [lo, hi) (relative to the owned slice) of
        at most ``max_elems``: (lo, hi, {"master", "exp_avg", "exp_avg_sq"}), fp32. The checkpoint
        reads (and with ``write=True`` overwrites) state only through this, so state held elsewhere
        (host, NVMe) can stream tile by tile; what a ``write`` caller copied into a tile is kept
        when the iteration moves on. Here the state is resident: the tiles are views."""
        n = self.master.numel()
        for a in range(0, n, max(1, max_elems)):
            b = min(n, a + max_elems)
            yield a, b, {"master": self.master[a:b], "exp_avg": self.exp_avg[a:b], "exp_avg_sq": self.exp_avg_sq[a:b]}

    def refresh_params(self) -> None:
        """Re-derives the 16-bit owned parameters from the master (after a checkpoint load wrote it)."""
        if self.param_out is not None:
            ops.cast(self.master, self.param_out)

    def load_master(self, a: int, b: int, values: torch.Tensor) -> None:
        """Writes ``values`` into the master's owned-range elements [a, b)."""
        self.master[a:b] = values

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
