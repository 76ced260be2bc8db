"""The NVMe side of OffloadPlan: the start-up checks of ``nvme_path`` (at initialize), one rank's
SwapStore (made when the first group needs it) and the free-space check as groups are added."""
from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist

from ...config.aio import aio_settings
from ...config.schema import ZeroOptimizationConfig
from .checks import check_free_space, check_nvme_path, free_bytes
from .records import record_bytes
from .shard import NvmeOptimizerShard, SwapOptions
from .store import SwapStore

log = logging.getLogger("zerocore.offload")
OPT_KEY = "zero_optimization.offload_optimizer"
DEFAULT_SUB_GROUP = next(f.default for f in dataclasses.fields(ZeroOptimizationConfig) if f.name == "sub_group_size")
NVME_TILE = 1 << 24  # elements per tile when sub_group_size is left at its default: 192 MiB buffers


class NvmeSwap:
    def __init__(self, config):
        z = config.zero_optimization
        opt = z.offload_optimizer  # ratio 1 with nvme: checked by the schema (OffloadOptimizerConfig.check)
        check_nvme_path(f"{OPT_KEY}.nvme_path", opt.nvme_path)
        self.path = opt.nvme_path
        tile = z.sub_group_size
        if tile == DEFAULT_SUB_GROUP:  # not chosen: DeepSpeed's 1e9 would make each pinned buffer 12 GB
            tile = NVME_TILE
            log.info("zerocore nvme: sub_group_size not set; NVMe tiles of %d elements (%d MiB per buffer, %d "
                     "buffers)", tile, record_bytes(tile) >> 20, opt.buffer_count)
        self.opts = SwapOptions(tile=tile, fast_init=opt.fast_init, pipeline_read=opt.pipeline_read,
                                pipeline_write=opt.pipeline_write)
        self.aio = aio_settings(config.aio)  # the backend included: aio.backend picks it
        self.buffer_count = opt.buffer_count
        self.free = free_bytes(self.path)
        self.needed = 0
        self.store: SwapStore | None = None

    @staticmethod
    def build(config) -> "NvmeSwap | None":
        if config.zero_optimization.offload_optimizer.device != "nvme":
            return None
        return NvmeSwap(config)

    def make_shard(self, g, init: torch.Tensor, pin: bool) -> NvmeOptimizerShard:
        if self.store is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            self.store = SwapStore(self.path, rank, self.aio, self.buffer_count)
        probe = NvmeOptimizerShard.size_on_disk(g.hi - g.lo, self.opts.tile)
        self.needed += probe
        check_free_space(f"{OPT_KEY}.nvme_path", self.path, self.needed, self.free,
                         f"optimizer state of this rank's groups 0..{g.index}: fp32 master, m and v, two slots "
                         "per tile; and at least as much on every other rank sharing the drive")
        return NvmeOptimizerShard(g, init, store=self.store, opts=self.opts, pin=pin)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
