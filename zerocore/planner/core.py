"""One configuration planned: the dry engine built on fake tensors and one step traced.

The result is per rank (every rank holds the same: flat groups are padded so each rank's chunk
has the same size). A model with more than ``max_traced_layers`` blocks is traced twice with
only its first two and three blocks, and every figure extended linearly to the full depth:
tracing a 7B model op by op takes tens of seconds even on fake tensors, and each block adds the
same bytes (its parameters, state and saved activations; the gathered units, buckets and
in-flight gradients at the peak are those of one block either way).
"""
from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ..config import ZeroConfig
from ..runtime.model_setup import training_dtype as dtype_of
from . import batches, dry_engine, fake_ops
from .trace import StepMemory, trace_step

CUDA_BLOCK = 512
PER_BLOCK = ("model_states", "activations")  # parts of the peak that every block adds to  # the CUDA caching allocator's rounding of every block


@dataclasses.dataclass
class Plan:
    between: dict[str, int]
    peak: int
    at_peak: dict[str, int]
    peak_by_device: dict[str, int]
    rounding: int
    nvme_bytes: int
    traced_layers: int | None  # None: the whole model was traced


def _run_forward(batch: int, seq: int, device: torch.device, vocab: int):
    return lambda module: batches.lm_loss(module, batch, seq, device, vocab)


def block_list(module: nn.Module) -> tuple[nn.Module, str, nn.ModuleList] | None:
    """(owner, attribute, list) of the model's longest ModuleList: its blocks."""
    best = None
    for owner in module.modules():
        for name, child in owner.named_children():
            if isinstance(child, nn.ModuleList) and (best is None or len(child) > len(best[2])):
                best = (owner, name, child)
    return best


def truncated(meta_module: nn.Module, keep: int) -> nn.Module:
    """A copy of the meta module with only its first ``keep`` blocks."""
    m = copy.deepcopy(meta_module)
    owner, name, blocks = block_list(m)
    setattr(owner, name, nn.ModuleList(list(blocks)[:keep]))
    cfg = getattr(m, "config", None)
    for key in ("num_hidden_layers", "n_layer"):
        if cfg is not None and hasattr(cfg, key):
            setattr(cfg, key, keep)
    return m


def _trace(meta_module, config, world, rank, micro_batch, seq_len, checkpointing, device, vocab) -> StepMemory:
    steps = 2 if config.zero_optimization.stage == 3 else 1
    with fake_ops.fake_aware_kernels(), FakeTensorMode(allow_non_fake_inputs=False):
        module = dry_engine.fake_module(meta_module, device)
        if checkpointing:
            batches.enable_checkpointing(module)
        engine = dry_engine.build(module, config, world, rank, device)
        return trace_step(engine, _run_forward(micro_batch, seq_len, device, vocab), steps=steps)


def _extend(a, b, k1: int, k2: int, n: int):
    """Linear in the number of blocks through (k1, a) and (k2, b), read at n."""
    if isinstance(a, dict):
        return {k: _extend(a[k], b.get(k, 0), k1, k2, n) for k in a}
    return int(round(a + (b - a) * (n - k1) / (k2 - k1)))


def plan_one(meta_module, config: ZeroConfig, *, world: int, micro_batch: int, seq_len: int,
             checkpointing: bool = False, device: torch.device | str = "cpu", rank: int = 0,
             max_traced_layers: int = 4) -> Plan:
    device = torch.device(device)
    vocab = batches.vocab_size(meta_module)
    found = block_list(meta_module)
    n = len(found[2]) if found else 0
    args = (config, world, rank, micro_batch, seq_len, checkpointing, device, vocab)
    if n <= max(max_traced_layers, 3):
        m = _trace(meta_module, *args)
        return Plan(m.between, m.peak, m.at_peak, m.peak_by_device, m.rounding, m.nvme, None)
    k1, k2 = 2, 3
    a, b = (_trace(truncated(meta_module, k), *args) for k in (k1, k2))
    # Per-block parts grow with the depth; the rest (gathered units, buckets, gradients not yet
    # bucketed) is that of the deeper trace: it belongs to the blocks around the peak, not to all.
    at_peak = dict(b.at_peak)
    for key in PER_BLOCK:
        at_peak[key] = _extend(a.at_peak[key], b.at_peak[key], k1, k2, n)
    if b.at_peak["gathered"] > a.at_peak["gathered"]:
        # the prefetch window holds more units than the short traces have: it grows with the depth
        # until stage3_prefetch_bucket_size (or stage3_max_live_parameters) stops it
        z = config.zero_optimization
        unit = b.at_peak["gathered"] - a.at_peak["gathered"]
        elem = torch.empty(0, dtype=dtype_of(config)).element_size()
        cap = b.at_peak["gathered"] + max(0, min(z.stage3_prefetch_bucket_size, z.stage3_max_live_parameters) * elem
                                          - (b.at_peak["gathered"] - unit))
        at_peak["gathered"] = min(_extend(a.at_peak["gathered"], b.at_peak["gathered"], k1, k2, n), cap)
    peak = sum(at_peak.values())
    by_device = {d: v + peak - b.peak for d, v in b.peak_by_device.items()} if len(b.peak_by_device) == 1 else \
        _extend(a.peak_by_device, b.peak_by_device, k1, k2, n)
    return Plan(_extend(a.between, b.between, k1, k2, n), peak, at_peak, by_device,
                _extend(a.rounding, b.rounding, k1, k2, n), _extend(a.nvme, b.nvme, k1, k2, n), k2)
