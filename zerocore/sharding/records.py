"""The records every stage shares: which bytes belong to which parameter.

A :class:`ParamSlot` is one parameter's place in its group's flat buffer; a :class:`FlatGroup`
is the unit that communicates together, padded so that it splits into ``world`` equal,
aligned chunks (rank r owns ``[r*S, (r+1)*S)``). Parameters may straddle chunk boundaries.
State dicts, consolidation and resharding read offsets from here and never recompute them.
Stages 1/2 build groups by size (``reduce_bucket_size``); stage 3 builds one group per wrapped
module (a unit), through the same :func:`build_groups` with ``split_at`` unit boundaries.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import torch

# Every chunk is a multiple of this many elements: 64 bytes for 16-bit chunks and 128 for
# fp32 ones, so each rank's slice starts cache-line aligned for the SIMD kernels. (NVMe
# offload needs 4 KiB: it passes its own alignment.)
ALIGN_ELEMS = 32


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """One trainable parameter inside a flat group."""

    name: str  # the first name the module gives it
    aliases: tuple[str, ...]  # every name it has (tied weights have several), name first
    shape: torch.Size
    dtype: torch.dtype  # the training dtype (what the flat buffer holds)
    group: int
    offset: int  # element offset inside the group's flat buffer
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclasses.dataclass(frozen=True)
class FlatGroup:
    """A set of parameters packed into one flat buffer of ``padded`` elements."""

    index: int
    slots: tuple[ParamSlot, ...]
    dtype: torch.dtype
    numel: int  # elements covered by parameters
    padded: int  # buffer length: a multiple of world * align
    world: int

    @property
    def chunk(self) -> int:
        """Elements per rank."""
        return self.padded // self.world

    def range_of(self, rank: int, parts: int | None = None) -> tuple[int, int]:
        """[lo, hi) of partition ``rank`` when the buffer is split in ``parts`` (default: world)
        equal pieces; ``parts=1`` is the whole buffer (stage 0 owns everything)."""
        parts = self.world if parts is None else parts
        size = self.padded // parts
        return rank * size, (rank + 1) * size

    def pieces(self, lo: int, hi: int) -> Iterator[tuple[ParamSlot, int, int]]:
        """For each slot overlapping flat range [lo, hi): (slot, start, stop) in the slot's own
        flattened coordinates; the flat position of ``start`` is ``slot.offset + start``."""
        for s in self.slots:
            a, b = max(lo, s.offset), min(hi, s.end)
            if a < b:
                yield s, a - s.offset, b - s.offset


def full_shape(p: torch.Tensor) -> torch.Size:
    """A parameter's shape, also when ``zerocore.init`` partitioned it at construction."""
    rec = getattr(p, "_zc_init", None)
    return rec.shape if rec is not None else p.shape


def padded_size(numel: int, world: int, align: int = ALIGN_ELEMS) -> int:
    unit = world * align
    return max(unit, -(-numel // unit) * unit)


def build_groups(named: Sequence[tuple[tuple[str, ...], torch.Tensor]], *, bucket_elems: int, world: int,
                 dtype: torch.dtype, align: int = ALIGN_ELEMS, split_at: Sequence[int] = (),
                 first_index: int = 0) -> list[FlatGroup]:
    """Packs parameters, in the order given, into groups of at most ``bucket_elems`` elements
    (a parameter larger than that gets a group of its own). ``named``: (names, parameter) pairs.
    ``split_at``: indices into ``named`` where a new group must start (unit boundaries).
    ``first_index``: the index of the first group (groups already built by the caller).
    A parameter's shape is its full one also when construction-time partitioning
    (``zerocore.init``) left only a chunk of it on this rank."""
    if bucket_elems < 1:
        raise ValueError("bucket_elems must be >= 1")
    splits = set(split_at)
    groups: list[FlatGroup] = []
    base = first_index
    pending: list[tuple[tuple[str, ...], torch.Tensor]] = []

    def close():
        if not pending:
            return
        slots, off = [], 0
        for names, p in pending:
            shape = full_shape(p)
            n = shape.numel()
            slots.append(ParamSlot(names[0], tuple(names), shape, dtype, base + len(groups), off, n))
            off += n
        groups.append(FlatGroup(base + len(groups), tuple(slots), dtype, off, padded_size(off, world, align), world))
        pending.clear()

    size = 0
    for i, (names, p) in enumerate(named):
        if pending and (i in splits or size + full_shape(p).numel() > bucket_elems):
            close()
            size = 0
        pending.append((names, p))
        size += full_shape(p).numel()
    close()
    return groups
