"""Sharded checkpoints: save and resume at any world size and stage, atomic and verified; offline
consolidation to safetensors.

Storage choice: one raw file per rank plus a JSON manifest, not ``torch.distributed.checkpoint``.
DCP's chunks are boxes in a tensor's shape, while a rank's slice of a flat group cuts rows (every
parameter would have to be re-registered as 1-D); its FileSystemReader reads each overlapping
stored item whole through ``torch.load`` and then narrows it, so a rank would read whole chunks
rather than the overlapping bytes; it needs every tensor resident in a state dict, where offloaded
state should stream tile by tile; and it keeps no per-block checksums to verify partial reads. The
format here is a manifest of chunks in each parameter's own flattened coordinates
(``manifest.py``), sequential per-rank files with a CRC32C per 1 MiB block written and read through
aligned buffers and ``zerocore.ops.AsyncIO`` (``blockio.py``, writing in ``block_writer.py``), and
reads planned by intersection (``reader.py``).

Entry points: ``engine.save_checkpoint`` / ``engine.load_checkpoint`` (``save.py``, ``load.py``
with its plan in ``load_plan.py``, its staging in ``staging.py`` and its reads straight into the state in
``load_in_place.py``,
``async_save.py``); offline, one process and no process group: :func:`consolidate`,
:func:`load_full_state_dict`, :func:`inspect` and the ``zerocore consolidate`` / ``zerocore
inspect`` commands (``offline.py``, ``cli.py``).
"""
from .layout import CheckpointError
from .blockio import ChecksumError
from .offline import consolidate, inspect, load_full_state_dict

__all__ = ["CheckpointError", "ChecksumError", "consolidate", "inspect", "load_full_state_dict"]
