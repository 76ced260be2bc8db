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
from .._weak import back_ref
from .group import ShardedGroup
from .state import GradState, expect_all


@dataclasses.dataclass
class AdamHyper:
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    decoupled: bool  # AdamW


# A shard's owned range in pieces of one hyper-parameter group each: (a, b, group) relative to the
# owned range, covering it. The engine sets ``shard.pieces``; one piece of group 0 by default.
Pieces = list[tuple[int, int, int]]


def step_plan(pieces: Pieces | None, n: int, hp) -> list[tuple[int, int, AdamHyper]]:
    """(a, b, hyper-parameters) over the owned range of ``n`` elements. ``hp``: one AdamHyper for
    every piece, or a list indexed by hyper group. Copies, so a step queued for a worker keeps
    this step's values whatever the user changes meanwhile."""
    if isinstance(hp, AdamHyper):
        one = dataclasses.replace(hp)
        return [(a, b, one) for a, b, _ in pieces] if pieces else [(0, n, one)]
    copies = {}
    plan = []
    for a, b, h in pieces or [(0, n, 0)]:
        if h not in copies:
            copies[h] = dataclasses.replace(hp[h])
        plan.append((a, b, copies[h]))
    return plan


def clip_plan(plan, lo: int, hi: int):
    """The pieces of ``plan`` inside [lo, hi), relative to ``lo``."""
    for a, b, hp in plan:
        a2, b2 = max(a, lo), min(b, hi)
        if a2 < b2:
            yield a2 - lo, b2 - lo, hp


def page_aligned_empty_like(t: torch.Tensor) -> torch.Tensor:
    """Uninitialised fp32 elements as many as ``t`` has, on its device; on the CPU in page-aligned
    memory, which a checkpoint load fills by O_DIRECT in place, with no copy
    (``checkpoint.blockio.read_into``). A fake or meta tensor (the planner's dry run) gets its kind."""
    n = t.numel()
    if type(t) is torch.Tensor and t.device.type == "cpu" and n:
        try:
            return ops.aligned_pinned_empty(n, torch.float32, lock=False)
        except (RuntimeError, OSError):  # the extension's allocator is unavailable: torch's memory works too
            pass
    return torch.empty_like(t, dtype=torch.float32).view(-1)


class OptimizerShard:
    # The optimizer-shard protocol the engine, offload and checkpoints read (every shard kind sets
    # all three): ``batched``: stepped inside the engine's multi-tensor call (device-resident
    # state), else by its own ``step``; ``reads_ahead``: its state streams from storage and reads
    # the next stepped shard's first tile ahead (``then``, NVMe); ``tiles_kept``: the tensors
    # ``state_tiles`` yields keep their contents until the whole iteration is done (views of
    # resident state), so a checkpoint may write them to disk from where they are; False where a
    # tile's memory is reused for the next one (NVMe streams through one buffer).
    batched = True
    reads_ahead = False
    tiles_kept = True
    # The group this shard steps: a weak back-reference (the engine owns both; with offload the group
    # holds its shard's readiness, and a strong reference back would close a cycle).
    group = back_ref()

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
            self.master = page_aligned_empty_like(owned).copy_(owned)
            self.param_out = group.owned_params()
        self.exp_avg = page_aligned_empty_like(self.master).zero_()
        self.exp_avg_sq = page_aligned_empty_like(self.master).zero_()
        self.tile = tile or self.master.numel() or 1
        self.pieces: Pieces | None = None

    def step(self, grad: torch.Tensor, hp, *, step: int, grad_scale: float) -> None:
        """This shard alone (the engine steps all resident shards together: MultiShardStep).
        ``hp``: an AdamHyper, or one per hyper group (see ``step_plan``)."""
        MultiShardStep([self], [0]).step([grad], hp, step=step, grad_scale=grad_scale)

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


def owned_grads(groups: list[ShardedGroup]) -> list[torch.Tensor]:
    """``g.owned_grad()`` of every group (the step reads them once for the norm and the update), with
    no Python call per group; raises, naming the group, if one is not HELD."""
    expect_all([g.grad_state for g in groups], GradState.HELD)
    return [g.owned_grad_tensor for g in groups]


class MultiShardStep:
    """The Adam step of many device-resident shards that share the step count, as one
    multi-tensor native call per hyper-parameter group and kind of output (with or without
    16-bit ``param_out``) instead of a call per group and tile. Each shard's ``tile`` still caps the
    elements of one kernel tensor (``sub_group_size``): a shard contributes one tensor per tile.

    The state-tensor lists are built once; ``step`` only slices the gradients, and rebuilds the
    lists if a shard's state tensors were replaced (they are written in place by checkpoints)."""

    def __init__(self, shards: list[OptimizerShard], index: list[int]):
        """``index[k]``: where shard k's gradient is in the list ``step`` gets."""
        self.shards, self.index = shards, index
        self._tensors: list[torch.Tensor | None] = []
        self._calls: list[tuple[int, list, list, list, list | None, list]] = []

    def _plan(self) -> None:
        self._tensors = [t for s in self.shards for t in (s.master, s.exp_avg, s.exp_avg_sq, s.param_out)]
        calls = {}
        for k, s in enumerate(self.shards):
            out = s.param_out is not None
            src = getattr(s, "sources", None)  # (master, m, v) read instead of the above: an out-of-place step
            n = s.master.numel()
            for lo, hi, h in s.pieces or [(0, n, 0)]:
                params, ms, vs, outs, cuts, srcs = calls.setdefault(
                    (h, out), ([], [], [], [] if out else None, [], ([], [], []) if src is not None else None))
                for a in range(lo, hi, s.tile):
                    b = min(hi, a + s.tile)
                    params.append(s.master[a:b])
                    ms.append(s.exp_avg[a:b])
                    vs.append(s.exp_avg_sq[a:b])
                    if out:
                        outs.append(s.param_out[a:b])
                    if srcs is not None:
                        for lst, t in zip(srcs, src):
                            lst.append(t[a:b])
                    cuts.append((self.index[k], a, b, a == 0 and b == n))
        self._calls = [(h,) + c for (h, _), c in calls.items()]

    def _stale(self) -> bool:
        if len(self._tensors) != 4 * len(self.shards):
            return True
        i = 0
        for s in self.shards:
            t = self._tensors
            if t[i] is not s.master or t[i + 1] is not s.exp_avg or t[i + 2] is not s.exp_avg_sq \
                    or t[i + 3] is not s.param_out:
                return True
            i += 4
        return False

    def step(self, grads: list[torch.Tensor], hp, *, step: int, grad_scale: float) -> None:
        """``grads[index[k]]``: shard k's owned gradient. ``hp``: an AdamHyper for every shard, or
        a list of them indexed by hyper group."""
        if self._stale():
            self._plan()
        one = hp if isinstance(hp, AdamHyper) else None
        for h, params, ms, vs, outs, cuts, srcs in self._calls:
            if not params:
                continue
            gs = []
            for k, a, b, whole in cuts:
                gs.append(grads[k] if whole else grads[k][a:b])
            p = one or hp[h]
            ops.adam_step_multi(params, gs, ms, vs, steps=[step] * len(params), lr=p.lr, betas=p.betas,
                                eps=p.eps, weight_decay=p.weight_decay, adamw_mode=p.decoupled,
                                grad_scale=grad_scale, param_outs=outs, sources=srcs)
