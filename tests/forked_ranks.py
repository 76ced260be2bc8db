"""Rank processes for the tests, started from a fork server that imported torch and zerocore once.

``torch.multiprocessing``'s "spawn" start method makes every rank a fresh interpreter that imports torch and
zerocore again: about 2 s for 2 ranks and 4 s for 4 on CI's 2 cores, per spawn, for hundreds of spawns. A fork
server (Python's "forkserver" start method) imports them once and forks each rank from that clean process (it never
ran a torch operation, a thread pool or a process group: forking it is safe, unlike forking pytest itself):
0.05-0.1 s a spawn. The forked rank then sees the fork server's environment, not this process's now: each rank
takes this process's ``os.environ`` as it is at the call (tests set variables before they spawn), before the
target runs; zerocore reads its variables when used, never at import.
"""
from __future__ import annotations

import os

import torch.multiprocessing as mp

_PRELOAD = ["torch", "torch.distributed", "zerocore"]


def _with_env(rank: int, fn, env: dict, *args) -> None:
    os.environ.clear()
    os.environ.update(env)
    fn(rank, *args)


def start_ranks(fn, args: tuple, nprocs: int, join: bool = False, fresh: bool = False):
    """``torch.multiprocessing.start_processes(fn, args, nprocs, join)`` through the fork server (``fn(rank, *args)``
    in each rank, module-level, as for "spawn"). ``fresh``: new interpreters ("spawn"), for ranks that need what
    is read only when a process starts (glibc's ``MALLOC_*`` tunables of the memory tests)."""
    if fresh or os.environ.get("ZC_TEST_SPAWN") == "1":  # (ZC_TEST_SPAWN=1: every rank a new interpreter)
        return mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method="spawn")
    mp.set_forkserver_preload(_PRELOAD)  # (read when the fork server starts: the first call)
    return mp.start_processes(_with_env, args=(fn, dict(os.environ), *args), nprocs=nprocs, join=join,
                              start_method="forkserver")
