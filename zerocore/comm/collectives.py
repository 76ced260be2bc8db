"""Bucket-level collectives, in place on flat buffers, async where the caller can overlap.

Flat buffers are laid out rank-major: rank r's chunk of a buffer of ``world * S`` elements is
``[r*S, (r+1)*S)``, so "reduce-scatter" and "all-gather" work in place on the bucket itself.

Backend strategy (measured, see benchmarks/reduce_scatter.py): on gloo a reduce-scatter of a
buffer takes about twice as long as an all-reduce of the same buffer, so ``reduce_scatter``
runs an in-place all-reduce there and the caller keeps its chunk; the bytes held are the same.
gloo's async reduce-scatter Work never reports ``is_completed()`` and has no future, so every
handle here is completed with ``wait()`` only.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import lifetime

# torch 2.13 renamed the flat-tensor collectives; keep working on older releases.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)
_all_gather_flat = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)


class Handle:
    """An in-flight collective; ``wait()`` (idempotent) blocks until it has completed."""

    __slots__ = ("_work",)

    def __init__(self, work=None):
        self._work = work

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None


# The handle of a collective that completed when issued (a world of one): shared, so the hot path
# makes no object for it and callers may skip ``wait()`` with an identity test.
DONE = Handle()


class Comm:
    """The ranks of one process group. ``Comm()`` is the default group; ``Comm.single()`` a
    world of one, where every collective is the identity and nothing touches torch.distributed.

    The default group is not held by reference (torch.distributed calls get ``group=None``), so
    ``destroy_process_group()`` really frees it and joins gloo's worker threads: a Python
    reference kept here made the group outlive it, and a gloo thread then released a finished
    Work's tensors during interpreter shutdown, aborting the process ("terminate called
    without an active exception", seen in about 1 exit in 5 here).
    """

    def __init__(self, group=None, *, reduce_scatter_via_all_reduce: bool | None = None, _single: bool = False):
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
        return Handle(_all_gather_flat(flat, self.chunk(flat), group=self.group, async_op=async_op))

    def all_gather_into(self, out: torch.Tensor, mine: torch.Tensor, async_op: bool = False) -> Handle:
        """Fills ``out`` (``world`` times the size of ``mine``) with every rank's ``mine``, rank-major.
        Stage 3 gathers a unit's owned chunk (kept apart) into its freshly allocated full buffer."""
        if out.numel() != mine.numel() * self.world:
            raise ValueError(f"all_gather_into: {out.numel()} elements out for {mine.numel()} in on {self.world} ranks")
        if self.world == 1:
            out.copy_(mine)
            return DONE
        return Handle(_all_gather_flat(out, mine, group=self.group, async_op=async_op))

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        if self.world > 1:
            dist.broadcast(t, src=src if self.group is None else dist.get_global_rank(self.group, src),
                           group=self.group)

    def sum_floats(self, values: list[float]) -> list[float]:
        """Sums a few Python floats over ranks in one small collective (float64)."""
        if self.world == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._scalar_device)
        dist.all_reduce(t, group=self.group)
        return t.tolist()
