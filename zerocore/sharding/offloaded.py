"""What offload hands a ``ShardedGroup``: one object, attached once (``ShardedGroup.attach_offload``).

The group never has its fields set from outside: it reads what it needs from this record when it is
attached (kept as plain attributes, so the per-gather test stays one attribute read), and offload
asks it for the deferred first gather after a queued host step through ``defer_next_gather()``.
"""
from __future__ import annotations

from typing import Callable


class GroupOffload:
    """One group's offload: its owned optimizer shard, its readiness and its on-gather action.

    - ``shard``: the optimizer shard offload made for the group (host or NVMe backed).
    - ``ready``: set when this step's host update is in the owned parameters (reads and gathers of
      the group wait for it: each unit waits only for its own).
    - ``on_gather(index)``: told of every gather (records the next step's order), or None.
    - ``queued``: the group's host steps are queued behind the next forward (stage 3), so its first
      gather after a step is deferred until the unit is waited for.
    """

    __slots__ = ("shard", "ready", "on_gather", "queued")

    def __init__(self, shard, ready, on_gather: Callable[[int], None] | None = None, queued: bool = False):
        self.shard = shard
        self.ready = ready
        self.on_gather = on_gather
        self.queued = queued
