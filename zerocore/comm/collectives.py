"""Bucket-level collectives, in place on flat buffers, async where the caller can overlap.

Flat buffers are laid out rank-major: rank r's chunk of a buffer of ``world * S`` elements is
``[r*S, (r+1)*S)``, so "reduce-scatter" and "all-gather" work in place on the bucket itself.

Backend strategy (measured, see benchmarks/reduce_scatter.py): on gloo a reduce-scatter of a
buffer takes about twice as long as an all-reduce of the same buffer, so ``reduce_scatter``
runs an in-place all-reduce there and the caller keeps its chunk; the bytes held are the same.
A large all-gather on gloo runs as one broadcast per rank of that rank's chunk, all in flight:
gloo's all-gather (``all_gather_into_tensor``) copies through temporary buffers; measured with
benchmarks/all_gather.py (results/all_gather_gloo_w*.txt), a 200 MB gather of six buffers took
3.0-3.6x the wall time and ~4x the CPU of the broadcasts at 2 ranks (2.6-2.8x at 4), one buffer of
2-16 MB 1.5-2.2x. Below ``BROADCAST_GATHER_MIN_BYTES`` the two are within noise, and the one
collective is kept there.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..debug.host_waits import mark_host
from . import lifetime

# torch 2.13 renamed the flat-tensor collectives; keep working on older releases.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)
_all_gather_flat = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)


class Handle:
    """An in-flight collective; ``wait()`` (idempotent) blocks until it has completed."""

    __slots__ = ("_works",)

    def __init__(self, work=None):
        self._works = work if isinstance(work, list) else ([] if work is None else [work])

    def wait(self, timeout=None) -> None:
        """``timeout`` (a ``datetime.timedelta``) bounds each backend wait; the backend raises
        when it passes."""
        while self._works:
            w = self._works[0]
            if timeout is None:
                w.wait()
            else:
                w.wait(timeout=timeout)
            self._works.pop(0)


# The handle of a collective that completed when issued (a world of one): shared, so the hot path
# makes no object for it and callers may skip ``wait()`` with an identity test.
DONE = Handle()

# From this size (bytes of the gathered buffer) an all-gather on gloo runs as broadcasts.
BROADCAST_GATHER_MIN_BYTES = 2 << 20


class Comm:
    """The ranks of one process group. ``Comm()`` is the default group; ``Comm.single()`` a
    world of one, where every collective is the identity and nothing touches torch.distributed.

    The default group is not held by reference (torch.distributed calls get ``group=None``), so
    ``destroy_process_group()`` really frees it and joins gloo's worker threads: a Python
    reference kept here made the group outlive it, and a gloo thread then released a finished
    Work's tensors during interpreter shutdown, aborting the process ("terminate called
    without an active exception", seen in about 1 exit in 5 here).
    """

    def __init__(self, group=None, *, reduce_scatter_via_all_reduce: bool | None = None,
                 all_gather_via_broadcast: bool | None = None, _single: bool = False):
        if _single:
            self.group, self.rank, self.world, self.backend = None, 0, 1, "none"
        else:
            if group is not None and group is dist.group.WORLD:
                group = None
            self.group = group
            self.rank = dist.get_rank(group)
            self.world = dist.get_world_size(group)
            self.backend = str(dist.get_backend(group)).lower()
            lifetime.note_comm(self)
        if reduce_scatter_via_all_reduce is None:
            reduce_scatter_via_all_reduce = self.backend == "gloo"
        self.reduce_scatter_via_all_reduce = reduce_scatter_via_all_reduce
        if all_gather_via_broadcast is None:
            all_gather_via_broadcast = self.backend == "gloo"
        self.all_gather_via_broadcast = all_gather_via_broadcast
        # each rank's global rank: the ``src`` a broadcast in a subgroup names
        self._global = (list(range(self.world)) if self.group is None
                        else [dist.get_global_rank(self.group, r) for r in range(self.world)])
        # NCCL reduces only device tensors; the few scalars of a step travel there.
        self._scalar_device = (torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl"
                               else torch.device("cpu"))

    @classmethod
    def single(cls) -> "Comm":
        return cls(_single=True)

    def chunk(self, flat: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """Rank ``rank``'s (default: this rank's) chunk of a rank-major flat buffer."""
        s = flat.numel() // self.world
        r = self.rank if rank is None else rank
        return flat[r * s:(r + 1) * s]

    def reduce_scatter(self, flat: torch.Tensor, async_op: bool = False) -> Handle:
        """Sums ``flat`` over ranks; afterwards this rank's chunk of ``flat`` holds its slice of
        the sum (the rest of ``flat`` is unspecified)."""
        if self.world == 1:
            return DONE
        if flat.numel() % self.world:
            raise ValueError(f"reduce_scatter: {flat.numel()} elements do not split over {self.world} ranks")
        if self.reduce_scatter_via_all_reduce:
            work = dist.all_reduce(flat, group=self.group, async_op=async_op)
        else:
            work = _reduce_scatter_flat(self.chunk(flat), flat, group=self.group, async_op=async_op)
        return Handle(work)

    def all_reduce(self, flat: torch.Tensor, async_op: bool = False) -> Handle:
        """Sums ``flat`` over ranks, in place; every rank gets the same bits."""
        if self.world == 1:
            return DONE
        return Handle(dist.all_reduce(flat, group=self.group, async_op=async_op))

    def all_gather(self, flat: torch.Tensor, async_op: bool = False) -> Handle:
        """Fills every rank's chunk of ``flat`` from that rank's own chunk, in place."""
        if self.world == 1:
            return DONE
        if flat.numel() % self.world:
            raise ValueError(f"all_gather: {flat.numel()} elements do not split over {self.world} ranks")
        if self._broadcasts(flat):
            return self._gather_by_broadcast(flat, async_op)
        return Handle(_all_gather_flat(flat, self.chunk(flat), group=self.group, async_op=async_op))

    def all_gather_into(self, out: torch.Tensor, mine: torch.Tensor, async_op: bool = False) -> Handle:
        """Fills ``out`` (``world`` times the size of ``mine``) with every rank's ``mine``, rank-major.
        Stage 3 gathers a unit's owned chunk (kept apart) into its freshly allocated full buffer."""
        if out.numel() != mine.numel() * self.world:
            raise ValueError(f"all_gather_into: {out.numel()} elements out for {mine.numel()} in on {self.world} ranks")
        if self.world == 1:
            out.copy_(mine)
            return DONE
        if self._broadcasts(out):
            self.chunk(out).copy_(mine)
            return self._gather_by_broadcast(out, async_op)
        return Handle(_all_gather_flat(out, mine, group=self.group, async_op=async_op))

    def _broadcasts(self, flat: torch.Tensor) -> bool:
        return self.all_gather_via_broadcast and flat.numel() * flat.element_size() >= BROADCAST_GATHER_MIN_BYTES

    def _gather_by_broadcast(self, flat: torch.Tensor, async_op: bool) -> Handle:
        """The all-gather as ``world`` broadcasts, rank r's chunk from rank r, in place and all in
        flight (every rank issues them in the same order)."""
        works = [dist.broadcast(self.chunk(flat, r), src=self._global[r], group=self.group, async_op=True)
                 for r in range(self.world)]
        h = Handle(works)
        if not async_op:
            h.wait()
        return h

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        if not 0 <= src < self.world:
            raise ValueError(f"broadcast: src={src} is not a rank of this {self.world}-rank group")
        if self.world > 1:
            dist.broadcast(t, src=self._global[src], group=self.group)

    def sum_floats(self, values: list[float]) -> list[float]:
        """Sums a few Python floats over ranks in one small collective (float64). Through NCCL they
        travel in device memory, so reading the sum waits for the device: host values of a step go
        through ``host_side()``."""
        if self.world == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._scalar_device)
        if self._scalar_device.type == "cpu":  # host memory (zerocore.debug.host_waits: no device to wait for)
            mark_host(t)
        dist.all_reduce(t, group=self.group)
        return t.tolist()

    def host_side(self) -> "Comm":
        """This group's ranks over gloo, for host values (offload's gradient norm): ``sum_floats`` there
        waits for the other ranks, not for a device. This Comm itself where it is gloo already (or one
        rank). A collective the first time (a new group): call it on every rank at the same point."""
        if self.backend == "gloo" or self.world == 1:
            return self
        ranks = tuple(dist.get_process_group_ranks(self.group)) if self.group is not None else None
        return Comm(lifetime.new_side_group(("host", ranks), list(ranks) if ranks is not None else None,
                                            use_local_synchronization=ranks is not None))
