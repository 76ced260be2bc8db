"""``engine.optimizer.optimizer`` where DeepSpeed has a basic optimizer under its ZeRO wrapper (stages
1-3, or fp16/bf16) and the engine steps zerocore's Adam with no client optimizer: a read view of
this rank's optimizer state in torch's layout.

``param_groups[h]``: hyper-parameter group h's values and, as ``params``, the pieces of this rank's
fp32 master flats that belong to it (DeepSpeed's basic optimizer also holds the flat fp32 partitions,
not the model's parameters); ``state[piece]``: ``step`` (the Adam step count), ``exp_avg`` and
``exp_avg_sq``, views of the engine's own tensors (the engine updates them in place; writing them
writes the state). NVMe-offloaded state streams through swap buffers and has no place to view:
refused by name.
"""
from __future__ import annotations

import torch

from .._weak import GONE, back_ref


class ShardAdamView:
    _engine = back_ref()  # the engine keeps this view: a weak reference back

    def __init__(self, engine):
        if not all(getattr(s, "tiles_kept", True) for s in engine.shards):
            raise NotImplementedError("zerocore: engine.optimizer.optimizer: the optimizer state is offloaded to NVMe "
                                      "and streams through swap buffers; there is no resident state to show")
        self._engine = engine
        groups = [{"params": []} for _ in engine.optimizer.param_groups]
        self._state: dict[torch.Tensor, dict] = {}
        self._steps: list[torch.Tensor] = []
        # (engine group index, hyper group, master piece) of each piece, in order: DeepSpeed's stage-3
        # sub-groups (ZeroOptimizer.fp16_groups / fp32_partitioned_groups_flat)
        self.subgroups: list[tuple[int, int, torch.Tensor]] = []
        for k, shard in enumerate(engine.shards):
            pieces = shard.pieces or [(0, shard.master.numel(), 0)]
            for lo, hi, tile in shard.state_tiles(1 << 62):
                for a, b, h in pieces:
                    x, y = max(a, lo), min(b, hi)
                    if x >= y:
                        continue
                    master = tile["master"][x - lo:y - lo]
                    step = torch.zeros((), dtype=torch.float32)
                    self._steps.append(step)
                    groups[h]["params"].append(master)
                    self.subgroups.append((k, h, master))
                    self._state[master] = {"step": step, "exp_avg": tile["exp_avg"][x - lo:y - lo],
                                           "exp_avg_sq": tile["exp_avg_sq"][x - lo:y - lo]}
        self._groups = groups
        self.defaults = dict(engine.optimizer.defaults)

    def _live(self):
        engine = self._engine
        if engine is None:
            raise RuntimeError(GONE)
        return engine

    @property
    def param_groups(self) -> list[dict]:
        """The groups with the face's values now (a schedule's lr, an edit) and this view's pieces."""
        for mine, src in zip(self._groups, self._live().optimizer.param_groups):
            mine.update((k, v) for k, v in src.items() if k != "params")
        return self._groups

    @property
    def state(self) -> dict:
        """Each piece's state, its ``step`` the engine's Adam step count now."""
        count = self._live().optimizer_steps
        for step in self._steps:
            step.fill_(count)
        return self._state

    def state_dict(self) -> dict:
        """torch's layout: ``{"state": {index: state}, "param_groups": [{..., "params": [index, ...]}]}``,
        the pieces numbered in group order (the tensors are the engine's: ``torch.save`` copies them)."""
        groups, state = self.param_groups, self.state
        index: dict[int, int] = {}
        packed = []
        for g in groups:
            ids = []
            for p in g["params"]:
                index[id(p)] = len(index)
                ids.append(index[id(p)])
            packed.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
        return {"state": {index[id(p)]: dict(st) for p, st in state.items()}, "param_groups": packed}

    def __repr__(self) -> str:
        return f"ShardAdamView({len(self.param_groups)} groups, {len(self._state)} pieces of this rank's state)"
