"""One configuration planned: the dry engine built on fake tensors and one step traced.

The result is per rank (every rank holds the same: flat groups are padded so each rank's chunk
has the same size). A model with more than ``max_traced_layers`` blocks is traced twice with
only its first two and three blocks and extended to the full depth (``_deepen``): tracing a 7B
model op by op takes tens of seconds even on fake tensors, and each block adds the same bytes.
Not at stage 3 when the prefetch window spans two blocks or more (small blocks): then the window,
not the depth, decides what is gathered, and the whole model is traced.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ..config import ZeroConfig
from ..runtime.forward_autocast import forward_autocast
from ..runtime.model_setup import training_dtype as dtype_of
from . import batches, dry_engine, fake_ops
from .trace import StepMemory, trace_step

CUDA_BLOCK = 512
  # the CUDA caching allocator's rounding of every block


@dataclasses.dataclass
class Plan:
    between: dict[str, int]
    peak: int
    at_peak: dict[str, int]
    peak_by_device: dict[str, int]
    rounding: int
    nvme_bytes: int
    comm_scratch: int  # gloo only: at most this much more at the peak while an all-gather runs
    traced_layers: int | None  # None: the whole model was traced


def _run_forward(batch: int, seq: int, device: torch.device, vocab: int, autocast: tuple | None = None):
    return lambda module: batches.lm_loss(module, batch, seq, device, vocab, autocast=autocast)


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
        # torch_autocast: the forward as the engine runs it (lower-precision activations, autocast's weight copies)
        autocast = forward_autocast(config, device)
        return trace_step(engine, _run_forward(micro_batch, seq_len, device, vocab, autocast), steps=steps)


def _extend(a, b, k1: int, k2: int, n: int):
    """Linear in the number of blocks through (k1, a) and (k2, b), read at n."""
    if isinstance(a, dict):
        return {k: _extend(a[k], b.get(k, 0), k1, k2, n) for k in a}
    return int(round(a + (b - a) * (n - k1) / (k2 - k1)))


def _deepen(a: StepMemory, b: StepMemory, config, k1: int, k2: int, n: int) -> dict:
    """The peak breakdown of the n-block model from traces of k1 < k2 blocks.

    Every moment of the deeper trace is extended to the full depth: the model states by what each
    block adds; the activations by what each block adds at the most, times the share of the
    deeper trace's largest activations still alive at that moment (all of them around the turn
    from forward to backward, few at the end of backward); buckets and gradients not yet bucketed
    as they are (they belong to the blocks around that moment, not to all); gathered units as they
    are, unless more were kept gathered with more blocks (stage3_max_reuse_distance keeps every
    unit whose backward is near): then by the same per-block growth up to
    stage3_max_live_parameters. The largest total is the peak."""
    per_state = (b.between["total"] + b.between["host_total"] - a.between["total"] - a.between["host_total"]) / (k2 - k1)
    per_act = (b.at_most_activations["activations"] - a.at_most_activations["activations"]) / (k2 - k1)
    top = max(1, b.at_most_activations["activations"])
    more = n - k2
    ga, gb = (max(m["gathered"] for m in t.timeline) for t in (a, b))
    per_gathered = (gb - ga) / (k2 - k1)  # units kept gathered for reuse grow with the depth
    gathered_cap = config.zero_optimization.stage3_max_live_parameters * torch.empty(
        0, dtype=dtype_of(config)).element_size()
    best, best_total = None, -1
    for m in b.timeline:
        now = dict(m)
        now["model_states"] = int(m["model_states"] + more * per_state)
        now["activations"] = int(m["activations"] + more * per_act * max(0, m["activations"]) / top)
        if per_gathered > 0 and m["gathered"] > 0:
            grown = m["gathered"] + more * per_gathered * m["gathered"] / gb
            now["gathered"] = int(min(grown, max(gathered_cap, m["gathered"])))
        total = sum(now.values())
        if total > best_total:
            best, best_total = now, total
    return best


def plan_one(meta_module, config: ZeroConfig, *, world: int, micro_batch: int, seq_len: int,
             checkpointing: bool = False, device: torch.device | str = "cpu", rank: int = 0,
             max_traced_layers: int = 4) -> Plan:
    device = torch.device(device)
    vocab = batches.vocab_size(meta_module)
    found = block_list(meta_module)
    n = len(found[2]) if found else 0
    args = (config, world, rank, micro_batch, seq_len, checkpointing, device, vocab)
    if found and config.zero_optimization.stage == 3:
        # a prefetch window wider than the short traces' blocks would be cut short by them: trace it all
        z = config.zero_optimization
        per_block = sum(p.numel() for p in found[2][0].parameters())
        if min(z.stage3_prefetch_bucket_size, z.stage3_max_live_parameters) >= 2 * per_block:
            max_traced_layers = n
    if n <= max(max_traced_layers, 3):
        m = _trace(meta_module, *args)
        return Plan(m.between, m.peak, m.at_peak, m.peak_by_device, m.rounding, m.nvme, m.comm_scratch, None)
    k1, k2 = 2, 3
    a, b = (_trace(truncated(meta_module, k), *args) for k in (k1, k2))
    at_peak = _deepen(a, b, config, k1, k2, n)
    peak = sum(at_peak.values())
    by_device = {d: v + peak - b.peak for d, v in b.peak_by_device.items()} if len(b.peak_by_device) == 1 else \
        _extend(a.peak_by_device, b.peak_by_device, k1, k2, n)
    return Plan(_extend(a.between, b.between, k1, k2, n), peak, at_peak, by_device,
                _extend(a.rounding, b.rounding, k1, k2, n), _extend(a.nvme, b.nvme, k1, k2, n),
                b.comm_scratch if config.zero_optimization.stage == 3 else _extend(a.comm_scratch, b.comm_scratch, k1, k2, n),
                k2)
