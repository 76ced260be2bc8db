"""Host memory that holds a load's verified bytes until every rank has agreed to use them.

A load reads each block once into one staging region, verifies it there, and (after the ranks
agree that every one of them has all its bytes) copies it into the engine, so the checkpoint is
read once and a failed load still changes nothing. The region is fresh memory, faulted in by the
O_DIRECT reads themselves (about 0.45 CPU-seconds per GB on this project's VM, with the reading and
checksumming). Measured alternatives that lost: faulting it in first by one pass of stores
(0.45-0.55 CPU-s/GB for that pass alone), and transparent huge pages (about 0.1 CPU-s/GB when memory
is free in 2 MiB runs, but up to 2 CPU-s/GB of compaction when it is not, and an O_DIRECT read into
huge pages not yet present cost 2.5 CPU-s/GB; ``madvise(MADV_POPULATE_WRITE)`` first saved nothing
in 4 KiB pages and was as erratic in huge ones). It is freed when the load ends: a training job
loads once, and holding the rank's whole state twice for the rest of the run would cost more than
the faults.

The region is bounded by :func:`budget`; a rank whose state is larger reads it twice instead
(verify everything, agree, then read again tile by tile), the memory of a few I/O buffers.

An engine that has saved asynchronously already keeps host buffers of the size of its rank's
checkpoint file (:func:`held_buffers`, the image the next asynchronous save is copied into). A
load into such an engine stages in those buffers (:class:`HeldArena`) instead of fresh memory:
no page is faulted, and the engine holds no more memory afterwards than before.
"""
from __future__ import annotations

import torch

from .. import ops

ALIGN = 4096  # O_DIRECT wants every buffer's start aligned

# Bytes of staging a load may use; None: a quarter of the memory available when the load starts,
# at most MAX_AUTO_BYTES. Tests set it to force the two-pass path.
STAGING_BYTES: int | None = None
MAX_AUTO_BYTES = 16 << 30


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0  # unknown: no staging (the two-pass path needs only a few buffers)


def budget() -> int:
    """The most bytes a load may stage."""
    if STAGING_BYTES is not None:
        return STAGING_BYTES
    return min(MAX_AUTO_BYTES, _available_bytes() // 4)


def held_buffers(engine, create: bool = False) -> list | None:
    """The aligned I/O buffers ``engine`` keeps between checkpoints (filled by its first
    asynchronous save, reused by the next ones and by loads); None where it keeps none and
    ``create`` is false."""
    held = getattr(engine, "_zc_held_buffers", None)
    if held is None and create:
        held = engine._zc_held_buffers = []
    return held


def padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class Arena:
    """One aligned region handed out front to back in aligned slices (no reuse within a load)."""

    def __init__(self, nbytes: int):
        self.region = ops.aligned_pinned_empty(max(padded(nbytes), ALIGN), torch.uint8, lock=False)
        self._next = 0

    def take(self, nbytes: int) -> torch.Tensor:
        end = self._next + nbytes
        if end > self.region.numel():
            raise MemoryError(f"staging: {nbytes} bytes asked beyond the region's {self.region.numel()}")
        out = self.region[self._next:end]
        self._next = padded(end)
        return out

    def free(self) -> None:
        self.region = None


class HeldArena:
    """Staging made of an engine's kept buffers (:func:`held_buffers`, all of ``piece_bytes``): a
    whole buffer per read (a read is at most ``piece_bytes``), fresh ones where the list runs out.
    :meth:`free` gives back as many as the list held before (the fresh ones beyond are dropped)."""

    def __init__(self, held: list, piece_bytes: int):
        self.held = held
        self.keep = len(held)
        self.piece_bytes = piece_bytes
        self._taken: list[torch.Tensor] = []

    def fresh_bytes(self, reads: list[int]) -> int:
        """The fresh memory reads of these sizes would allocate."""
        usable = sum(1 for b in self.held if b.numel() == self.piece_bytes)
        small = [n for n in reads if n <= self.piece_bytes]
        return max(0, len(small) - usable) * self.piece_bytes + sum(padded(n) for n in reads if n > self.piece_bytes)

    def take(self, nbytes: int) -> torch.Tensor:
        if nbytes > self.piece_bytes:  # a checkpoint written with blocks larger than the buffers
            return ops.aligned_pinned_empty(padded(nbytes), torch.uint8, lock=False)[:nbytes]
        i = next((i for i, b in enumerate(self.held) if b.numel() == self.piece_bytes), None)
        buf = ops.aligned_pinned_empty(self.piece_bytes, torch.uint8, lock=False) if i is None else self.held.pop(i)
        self._taken.append(buf)
        return buf[:nbytes]

    def free(self) -> None:
        room = max(0, self.keep - len(self.held))
        self.held.extend(self._taken[:room])
        self._taken = []
