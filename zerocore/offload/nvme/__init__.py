"""NVMe offload of the optimizer state: the owned fp32 master, m and v of each group
rest in swap files and pass through a few pinned buffers tile by tile.

records.py  the on-disk record of one tile: header (identity, commit, length, CRC32) + payload
store.py    one rank's swap folder for one run, its AsyncIO handles and pinned buffers, cleanup
shard.py    NvmeOptimizerShard: a host-stepped shard whose state rests in swap files, pipelined and verified
checks.py   start-up checks of nvme_path (exists, directory, writable, O_DIRECT, free space)
plan.py     NvmeSwap: what OffloadPlan asks of the NVMe side
params.py   ParamSwap: stage-3 parameter shards beyond max_in_cpu, read ahead and written behind
"""
from .params import ParamReady, ParamSwap
from .plan import NvmeSwap
from .records import SwapCorruptError, SwapError
from .shard import NvmeOptimizerShard, SwapOptions
from .store import SwapStore

__all__ = ["ParamReady", "ParamSwap", "NvmeSwap", "SwapCorruptError", "SwapError",
           "NvmeOptimizerShard", "SwapOptions",
           "SwapStore"]
