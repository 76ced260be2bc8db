"""Loads that read a checkpoint straight into the engine's optimizer state: no staging region,
no copy, no fresh memory. The state's memory is page-aligned (``sharding.optimizer``) and saves
place every tile of it on a page of the file (``BlockWriter.write(paged=True)``), so the whole
blocks of a rank's pieces go by O_DIRECT from the disk into the state and are verified there
(``blockio.read_into``); only the partial blocks at the pieces' ends are copied. This is what a
job that resumes pays: about the disk's own CPU cost, against a staged load's page faults (fresh
staging) or copy (kept buffers).

What it gives up is the staged load's promise that a failed load changes nothing: bytes land in
the state before every block has been verified on every rank. So by default (``in_place=None``)
a load reads in place only where there is nothing to lose: the engine's state is still what
``initialize`` made (no optimizer step, no load, no ``gathered`` edit since), the resume of a
job. ``in_place=True`` reads in place into a trained engine too (``torch.distributed.checkpoint``
loads in place the same way); ``False`` never does.

A failed in-place load (a corrupt block anywhere, a short file, another rank's failure) leaves
the optimizer state partly overwritten on every rank. The engine records it: ``step()`` and
``save_checkpoint()`` raise, naming the failed load, until a load succeeds; the 16-bit
parameters are re-derived only after a load succeeded, so with 16-bit training the model keeps
the weights it had (with fp32 training the master is the parameters' own owned slice).

Only resident CPU state qualifies (fused Adam's master and moments whose tiles are views of
host memory: CPU training, host offload); state on a GPU, on NVMe or of a client optimizer is
staged.
"""
from __future__ import annotations

import torch

from ..runtime.checkpoint_marks import state_written
from .blockio import as_bytes
from .load_plan import ShardPieces, spans

WHOLE = 1 << 62  # state_tiles in as few tiles as the shard has parts


def nothing_to_lose(engine) -> bool:
    """The engine's optimizer state is what ``initialize`` made: no update, load or edit since."""
    return engine.optimizer_steps == 0 and not state_written(engine)


def targets(engine, plan: list[list[tuple]]) -> tuple[list, list] | None:
    """Where each planned piece of state goes: ((file, byte offset, the state's bytes), ...) and
    the state's elements that no piece covers (padding, kinds not loaded: zeroed, as a staged load
    does); None where some state is not resident host memory."""
    reads, zeros = [], []
    for shard, pieces in zip(engine.shards, plan):
        if not shard.tiles_kept:
            return None
        planned = ShardPieces(pieces)
        for lo, hi, state in shard.state_tiles(WHOLE, write=True):
            copies = planned.in_tile(lo, hi)
            for k, dst in state.items():
                if dst.device.type != "cpu" or not dst.is_contiguous() or dst.dtype != torch.float32:
                    return None
                for x, n, file, off in spans(copies, k, hi - lo):
                    if file is None:
                        zeros.append(dst[x:x + n])
                    else:
                        reads.append((file, off, as_bytes(dst[x:x + n])))
    return reads, zeros


@torch.no_grad()
def read(reader, where: tuple[list, list]) -> None:
    """Zeroes the uncovered elements and reads every piece into place, verified (raises
    ChecksumError naming the file)."""
    reads, zeros = where
    for z in zeros:
        z.zero_()
    reader.read_into(reads)
