"""The engine's runtime objects for one rank, built on fake tensors: the same flat groups (the
engine's own ``engine_groups``), ``ShardedGroup`` / ``OptimizerShard`` / ``OffloadPlan`` shards,
``GradReducer`` buckets and stage 3's ``ParamGatherer`` with its prefetch limits, wired as
``Engine.__init__`` wires them. Nothing is allocated and no collective runs: ``PlanComm`` answers
every collective at once, in place (what gloo and NCCL do to memory: the bytes live in the
buffers the engine already holds).

NVMe optimizer state is the one placement not built from the engine's class (its constructor
writes swap files): ``PlannedNvmeShard`` holds the same host tensors ``NvmeOptimizerShard``
does (landed gradient, staging of the updated parameters, the store's shared record pool).
"""
from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..comm import DONE, Comm
from ..comm.collectives import Handle
from ..comm.divergence import DivergenceGuard
from ..config import ZeroConfig
from ..offload import OffloadPlan
from ..offload.speculation import plans_spare
from ..offload.nvme.plan import DEFAULT_SUB_GROUP, NVME_TILE
from ..offload.nvme.records import padded as nvme_padded
from ..offload.nvme.records import record_bytes
from ..offload.stepper import Ready
from ..runtime.buffer_dtypes import buffer_targets
from ..runtime.grad_norm import reduce_dtype
from ..runtime.frozen_groups import frozen_specs, gatherer_units, whole_frozen
from ..runtime.group_specs import engine_groups
from ..runtime.memory import held_bytes
from ..runtime.model_setup import accumulation_dtype, named_params, training_dtype
from ..sharding import GradReducer, OptimizerShard, ShardedGroup, policy_for
from ..sharding.gatherer import Limits, ParamGatherer


class PlanComm(Comm):
    """A rank of ``world`` whose collectives complete when waited for and move no bytes (what NCCL
    and gloo do to the memory of the buffers the engine holds).

    gloo's all-gather also copies through a scratch buffer of the output's size, on gloo's own
    thread, for as long as the collective runs (measured: torch 2.13's ProcessGroupGloo; NCCL
    writes in place). When that ends depends on scheduling, so it is not in the peak: ``scratch``
    records the largest one, the most a gloo run can add to the peak for those few milliseconds."""

    def __init__(self, world: int, rank: int = 0, backend: str = "gloo"):
        super().__init__(_single=True)
        self.world, self.rank, self.backend = world, rank, backend
        self.scratch = 0

    def _done(self, scratch_like: torch.Tensor | None = None):
        if self.world == 1:
            return DONE
        if scratch_like is not None and self.backend == "gloo":
            self.scratch = max(self.scratch, scratch_like.numel() * scratch_like.element_size())
        return Handle(None)

    def reduce_scatter(self, flat, async_op=False):
        return self._done()

    def all_reduce(self, flat, async_op=False):
        return self._done()

    def all_gather(self, flat, async_op=False):
        return self._done(flat)

    def all_gather_into(self, out, mine, async_op=False):
        return self._done(out)

    def broadcast(self, t, src=0):
        return None

    def sum_floats(self, values):
        return list(values)


class PlannedNvmeShard:
    """The host tensors of one group's ``NvmeOptimizerShard`` (see the module docstring)."""

    batched, reads_ahead = False, False  # OptimizerShard's protocol: no disk here to read ahead from
    tiles_kept = False  # as the NVMe shard it stands for

    def __init__(self, group: ShardedGroup, store: "PlannedSwapStore", tile: int):
        n = group.hi - group.lo
        self.group = group
        self.grad_h = torch.zeros(n, dtype=group.layout.dtype, device="cpu")
        self.staging = None  # made by tensors() where the shard it stands for makes one (_needs_staging)
        self.store = store
        self.tile = tile
        store.grow(max(1, min(n, nvme_padded(tile))))
        self.param_swap = None
        self.ready = Ready()
        self.enqueue = None

        self.last_step = 0

    # as NvmeOptimizerShard (a HostSteppedShard): the whole owned range on the host, zerocore's Adam,
    # so the device gradient is given back once landed (ShardedGroup.release_grad)
    releases_grad = property(lambda self: self.group.grad_full is None and self.group.grad_shard is not None)

    def land(self, grad: torch.Tensor) -> None:
        self.grad_h.copy_(grad)
        if self.releases_grad:
            self.group.release_grad()

    def landed_copy(self) -> torch.Tensor:
        return self.grad_h

    def read_first_tiles(self, step: int) -> None:
        """Reads into the store's pool, which is held anyway: no bytes of its own."""

    def _needs_staging(self) -> bool:
        """NvmeOptimizerShard's staging buffer exists unless it steps fp32 parameters in host memory of
        their own in place (its ``_direct``: a CPU device, no parameter swap)."""
        return (self.group.layout.dtype != torch.float32 or self.param_swap is not None
                or self.group.owned_params_raw().device.type != "cpu")

    def tensors(self) -> dict[str, torch.Tensor]:
        if self.staging is None and self._needs_staging():
            self.staging = torch.empty(self.group.hi - self.group.lo, dtype=self.group.layout.dtype, device="cpu")
        return {"host_grads": self.grad_h, "host_staging": self.staging, "host_swap": self.store.pool,
                "host_params": None}


class PlannedSwapStore:
    """``SwapStore``'s pinned pool: ``buffer_count`` records of the largest tile, one allocation."""

    def __init__(self, buffer_count: int):
        self.buffer_count = buffer_count
        self.tile = 0
        self.pool = torch.empty(0, dtype=torch.uint8, device="cpu")

    def grow(self, tile: int) -> None:
        if tile > self.tile:
            self.tile = tile
            self.pool = torch.empty(self.buffer_count * record_bytes(tile), dtype=torch.uint8, device="cpu")


class PlannedNvme:
    """Stands in for ``NvmeSwap`` in the dry run's ``OffloadPlan``: same tile choice, no files."""

    def __init__(self, config: ZeroConfig):
        z = config.zero_optimization
        self.tile = NVME_TILE if z.sub_group_size == DEFAULT_SUB_GROUP else z.sub_group_size
        self.store = PlannedSwapStore(z.offload_optimizer.buffer_count)
        self.path = z.offload_optimizer.nvme_path
        self.needed = 0

    def make_shard(self, g, init, pin):
        return PlannedNvmeShard(g, self.store, self.tile)


@dataclasses.dataclass
class DryEngine:
    """What ``held_bytes`` and the traced step need: the engine's attributes of the same names."""

    module: nn.Module
    config: ZeroConfig
    groups: list
    shards: list
    reducer: GradReducer
    gatherer: ParamGatherer | None
    offload: OffloadPlan | None
    dtype: torch.dtype
    comm: PlanComm
    frozen_groups: list = dataclasses.field(default_factory=list)  # stage 3's partitioned frozen parameters

    def held(self) -> dict[str, int]:
        return held_bytes(self, storage_key=lambda st: st._cdata)

    def nvme_bytes(self) -> int:
        """Swap-file bytes of this rank (two slots of every tile's record), as the engine sizes them."""
        from ..offload.nvme.shard import NvmeOptimizerShard

        return sum(NvmeOptimizerShard.size_on_disk(s.group.hi - s.group.lo, s.tile) for s in self.shards
                   if isinstance(s, PlannedNvmeShard))

    def rounding(self, block: int) -> int:
        """Bytes the CUDA caching allocator adds to the held tensors (each rounded up to ``block``)."""
        seen, extra = set(), 0
        for t in self.tensors():
            st = t.untyped_storage()
            if t.device.type == "cuda" and st._cdata not in seen and st.nbytes():
                seen.add(st._cdata)
                extra += -st.nbytes() % block
        return extra

    def tensors(self) -> list[torch.Tensor]:
        out = []
        for g, s in zip(self.groups, self.shards):
            out += [t for t in g.tensors().values() if t is not None]
            out += [t for t in s.tensors().values() if t is not None]
        for g in self.frozen_groups:
            out += [t for t in g.tensors().values() if t is not None]
        return out


def _without_nvme(config: ZeroConfig) -> ZeroConfig:
    """The config with NVMe optimizer offload as host offload (the placement is swapped in after)."""
    cfg = copy.deepcopy(config)
    cfg.zero_optimization.offload_optimizer.device = "cpu"
    return cfg


def fake_module(meta_module: nn.Module, device: torch.device) -> nn.Module:
    """A copy of ``meta_module`` whose parameters and buffers are fake tensors on ``device`` (call
    inside FakeTensorMode); shared parameters stay shared."""
    with unset_fake_temporarily():  # the copy is of meta tensors, not fake ones
        module = copy.deepcopy(meta_module)
    memo: dict[int, torch.Tensor] = {}
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is None:
                continue
            if id(p) not in memo:
                memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                           requires_grad=p.requires_grad)
            m._parameters[name] = memo[id(p)]
        for name, b in list(m._buffers.items()):
            if b is not None:
                if id(b) not in memo:
                    memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device=device)
                m._buffers[name] = memo[id(b)]
    return module


def build_states(specs, config: ZeroConfig, rank: int, device: torch.device):
    """Each spec's ShardedGroup and optimizer shard (with its offload placement), as
    ``Engine._add_group`` makes them, and each frozen spec's group as ``build_frozen_group`` does:
    (groups, shards, the gatherer's units, offload plan or None, frozen groups)."""
    z = config.zero_optimization
    dtype = training_dtype(config)
    nvme = z.offload_optimizer.device == "nvme"
    offload = OffloadPlan.build(_without_nvme(config) if nvme else config, device, lambda: True)
    if nvme:
        offload.nvme = PlannedNvme(config)
    groups, shards, units = [], [], []
    tile = z.sub_group_size if z.stage == 3 else None
    specs, cold = frozen_specs(specs)
    for spec in specs:
        init = torch.empty(spec.layout.padded, dtype=torch.float32, device=device)
        flat = init if dtype == torch.float32 else torch.empty(spec.layout.padded, dtype=dtype, device=device)
        g = ShardedGroup(spec.layout, spec.params, spec.policy, rank, device, param_flat=flat)
        shards.append(offload.make_shard(g, init, tile) if offload is not None else OptimizerShard(g, init, tile=tile))
        if offload is not None and plans_spare(config, shards[-1]):  # offload/speculation.py's second state
            shards[-1].make_spare()
        g.bind_params()
        if g.partitioned:
            g.free_full()
        groups.append(g)
        if spec.unit is not None:
            units.append((spec.unit[0], spec.unit[1], g))
    frozen = []
    for spec in cold:
        flat = torch.empty(spec.layout.padded, dtype=dtype, device=device)
        g = ShardedGroup(spec.layout, spec.params, spec.policy, rank, device, param_flat=flat)
        if offload is not None:
            offload.place_frozen(g)
        g.bind_params()
        g.free_full()
        frozen.append(g)
    return groups, shards, gatherer_units(units, list(zip(cold, frozen))), offload, frozen


def build(module: nn.Module, config: ZeroConfig, world: int, rank: int, device: torch.device,
          backend: str | None = None) -> DryEngine:
    """The engine's groups, shards, reducer and gatherer for ``module`` (fake parameters on
    ``device``), as ``Engine.__init__`` builds them; call inside FakeTensorMode."""
    z = config.zero_optimization
    comm = PlanComm(world, rank, backend or ("nccl" if device.type == "cuda" else "gloo"))
    policy = policy_for(z.stage, accumulation_dtype(config))
    dtype = training_dtype(config)
    trainable, frozen = named_params(module)
    if not trainable:
        raise ValueError("zerocore estimate: the model has no trainable parameters")
    specs = engine_groups(module, trainable, z, world, dtype, policy, frozen=frozen)
    groups, shards, units, offload, frozen_groups = build_states(specs, config, rank, device)
    for _, p in whole_frozen(frozen, frozen_groups):  # convert_rest: whole frozen parameters, floating buffers
        if p.is_floating_point() and p.dtype != dtype:
            p.data = torch.empty(p.shape, dtype=dtype, device=device)
    want = {id(b): d for b, d in buffer_targets(module, config.data_types, dtype)}  # convert_rest's rule
    for mod in module.modules():
        for name, b in list(mod._buffers.items()):
            if b is not None and id(b) in want:
                mod._buffers[name] = torch.empty(b.shape, dtype=want[id(b)], device=device)
    guard = DivergenceGuard(comm, lambda op, i: f"group {i}", enabled=False)
    gatherer = None
    if z.stage == 3:
        gatherer = ParamGatherer(module, units, comm, guard, Limits(
            prefetch_elems=z.stage3_prefetch_bucket_size, max_live=z.stage3_max_live_parameters,
            max_reuse=z.stage3_max_reuse_distance))
    reducer = GradReducer(groups, comm, overlap=z.overlap, reduce_scatter=z.reduce_scatter, device=device, guard=None,
                          on_complete=gatherer.on_group_complete if gatherer else None,
                          on_reduced=offload.on_reduced if offload else None,
                          reduce_dtype=reduce_dtype(z.reduce_dtype, dtype), unit_signals=gatherer is not None)
    if gatherer is not None:
        gatherer.on_unit_done = reducer.group_done
    return DryEngine(module, config, groups, shards, reducer, gatherer, offload, dtype, comm, frozen_groups)
