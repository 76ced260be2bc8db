"""A stage 1-2 load's re-gather of the full parameters, run while the rest of the state is read.

After a load writes the fp32 master, every rank's full 16-bit parameters must be re-derived: its
own chunk cast from its master, the others' chunks all-gathered. On gloo that all-gather costs as
much as a training step's (a quarter of the load's time on this project's benchmark), and a load
may not touch the parameters before every rank has agreed that every rank has all its bytes. So
the masters are read first; their verified bytes, still in staging, are cast into a side copy of
each group's flat parameters (host memory, the size of the full 16-bit parameters), and those side
copies are all-gathered while the moments are read. Once the ranks agree, the side copies are
copied into the parameters (a memory copy); if the load failed anywhere, they are dropped, and
the engine is as it was.

Every rank must issue the same collectives, so a load gathers ahead only where every rank can:
whether this one can (host parameters, resident Adam state, enough staging) is summed over the
ranks in one small collective, and a rank whose reads of the masters failed still joins the
all-gathers (with whatever its side copy holds) before the agreement fails the load everywhere.
"""
from __future__ import annotations

import torch

from .. import ops
from ..sharding import OptimizerShard, ParamState

_FP32 = 4
CAST_TILE_ELEMS = 1 << 20  # fp32 elements of the master cast at a time (through a small buffer)


def candidate(engine, ts) -> bool:
    """Whether this engine's loads may gather ahead (the same answer on every rank): its groups'
    full parameters are re-gathered after a load (stages 1-2, several ranks), live in host memory
    (on a GPU the collective is fast and a side copy would cost device memory), and the state is
    Adam's, resident (its refresh is a cast of the master)."""
    return (engine.policy.shard_optimizer and engine.comm.world > 1 and ts is None
            and all(type(s) is OptimizerShard for s in engine.shards)
            and bool(engine.groups)
            and all(not g.partitioned and g.param_flat.device.type == "cpu" for g in engine.groups))


def side_bytes(engine) -> int:
    return sum(g.param_flat.numel() * g.param_flat.element_size() for g in engine.groups)


class GatherAhead:
    """The side copies and their all-gathers in flight (see the module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        self.sides: list = []  # (group index, group, side copy) of every group
        self.inflight: list = []  # (handle, group, side copy)

    def prepare(self) -> None:
        """Allocates the side copies; before the ranks agree to gather ahead, so that a rank
        without the memory says so there instead of failing between collectives."""
        self.sides = [(i, g, torch.empty_like(g.param_flat)) for i, g in enumerate(self.engine.groups)]

    def start(self, plan: list[list[tuple]] | None, masters) -> Exception | None:
        """Casts the verified masters in ``masters`` (a run Fetch of ``plan``'s master pieces, per
        shard = per group; None where this rank failed before they were read) into each group's
        side copy and starts its all-gather, every group, in order. Every all-gather is started
        whatever happens here (every rank issues the same collectives): an error while casting is
        returned, for the load's agreement to fail."""
        err = None
        tmp = torch.empty(CAST_TILE_ELEMS, dtype=torch.float32)
        for i, g, side in self.sides:
            if masters is not None and err is None:
                try:
                    own = side[g.lo:g.hi]
                    own.zero_()  # padding, as the master's (a load zero-fills what the checkpoint does not cover)
                    for kind, o, _, n, file, off in plan[i]:
                        if kind != "master":
                            continue
                        for x in range(0, n, CAST_TILE_ELEMS):
                            m = min(CAST_TILE_ELEMS, n - x)
                            masters.copy_into(file, off + x * _FP32, tmp[:m])
                            _cast(tmp[:m], own[o + x:o + x + m])
                except Exception as e:  # noqa: BLE001 - reported through the load's agreement
                    err = e
            self.inflight.append((self.engine.comm.all_gather(side, async_op=True), g, side))
        self.sides = []
        return err

    def finish(self, use: bool) -> None:
        """Waits for every all-gather; ``use``: copies the side copies into the parameters (the
        load was agreed), else drops them."""
        inflight, self.inflight = self.inflight, []
        for h, g, side in inflight:
            h.wait()
            if use:
                g.param_state.to(ParamState.SHARDED)
                g.param_state.to(ParamState.GATHERING)
                g.param_flat.copy_(side)
                g.param_state.to(ParamState.GATHERED)


def _cast(src: torch.Tensor, dst: torch.Tensor) -> None:
    if dst.dtype == torch.float32:
        dst.copy_(src)
    else:  # the kernel the master's refresh uses: the same 16-bit values
        ops.cast(src, dst)

