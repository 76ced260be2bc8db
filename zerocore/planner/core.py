"""One configuration planned: the dry engine built on fake tensors and one step traced.

The result is per rank (every rank holds the same: flat groups are padded so each rank's chunk
has the same size). A model is traced with at most ``max_traced_layers`` blocks and the
figures of the per-block parts scaled to the full depth (two traces, of one and two blocks'
worth): tracing a 7B model op by op takes minutes even on fake tensors, and each block adds
the same bytes.
"""
from __future__ import annotations

import dataclasses

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..config import ZeroConfig
from . import batches, dry_engine, fake_ops
from .trace import StepMemory, trace_step

CUDA_BLOCK = 512  # the CUDA caching allocator's rounding of every block


@dataclasses.dataclass
class Plan:
    between: dict[str, int]
    peak: int
    at_peak: dict[str, int]
    peak_by_device: dict[str, int]
    rounding: int
    traced_layers: int | None  # None: the whole model was traced


def _run_forward(batch: int, seq: int, device: torch.device, vocab: int):
    return lambda module: batches.lm_loss(module, batch, seq, device, vocab)


def plan_one(meta_module, config: ZeroConfig, *, world: int, micro_batch: int, seq_len: int,
             checkpointing: bool = False, device: torch.device | str = "cpu", rank: int = 0) -> Plan:
    device = torch.device(device)
    vocab = batches.vocab_size(meta_module)
    steps = 2 if config.zero_optimization.stage == 3 else 1
    with fake_ops.fake_aware_kernels(), FakeTensorMode(allow_non_fake_inputs=False):
        module = dry_engine.fake_module(meta_module, device)
        if checkpointing:
            batches.enable_checkpointing(module)
        engine = dry_engine.build(module, config, world, rank, device)
        mem: StepMemory = trace_step(engine, _run_forward(micro_batch, seq_len, device, vocab), steps=steps)
    return Plan(mem.between, mem.peak, mem.at_peak, mem.peak_by_device, 0, None)
