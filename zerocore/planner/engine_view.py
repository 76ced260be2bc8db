"""The planner's figures for an engine that is already running (``engine.memory_report``): its
own flat-group layouts rebuilt on fake tensors with the same shards and placements (the model
states between steps), and, given a micro-batch and sequence length and a meta-device copy of
the model (a Hugging Face model's is rebuilt from its config), the whole step's plan."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ..runtime.group_specs import GroupSpec
from ..runtime.memory import held_bytes
from . import dry_engine, fake_ops
from .core import plan_one
from .model_source import from_hf_config


def with_prediction(engine, held: dict, micro_batch=None, seq_len=None, meta_model=None) -> dict:
    """``held`` (``runtime/memory.held_bytes``) plus ``predicted`` (the planner's model-state bytes
    by role for this rank) and, given a micro-batch and sequence length, ``predicted_step`` (its
    peak over one step, with breakdown): ``engine.memory_report(predicted=True)``."""
    out = dict(held)
    out["predicted"] = predicted_states(engine)
    if micro_batch is not None and seq_len is not None:
        out["predicted_step"] = predicted_step(engine, micro_batch, seq_len, meta_model)
    return out


def predicted_states(engine) -> dict[str, int]:
    """Model-state bytes by role (``held_bytes``' roles) the planner predicts for this rank."""
    grouped = {id(p) for g in engine.groups + engine.frozen_groups for p in g.params}
    with fake_ops.fake_aware_kernels(), FakeTensorMode():
        def fake(g):
            return [nn.Parameter(torch.empty(s.shape, dtype=g.layout.dtype, device=engine.device),
                                 requires_grad=g.policy.trains) for s in g.layout.slots]

        specs = [GroupSpec(g.layout, fake(g), g.policy, None) for g in engine.groups]
        specs += [GroupSpec(g.layout, fake(g), g.policy, None, frozen=True) for g in engine.frozen_groups]
        groups, shards, _, _, frozen = dry_engine.build_states(specs, engine.config, engine.comm.rank, engine.device)
        # parameters kept whole (frozen ones below stage 3, persistent or non-floating ones at stage 3):
        # their own tensors, in the dtype convert_rest gave them
        whole = [nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=p.device), requires_grad=False)
                 for p in engine.module.parameters() if id(p) not in grouped]
        view = SimpleNamespace(groups=groups, shards=shards, frozen_groups=frozen,
                               module=SimpleNamespace(parameters=lambda: whole),
                               reducer=SimpleNamespace(bucket_tensors=list))
        return held_bytes(view, storage_key=lambda st: st._cdata)


def predicted_step(engine, micro_batch: int, seq_len: int, meta_model: nn.Module | None = None) -> dict | None:
    """The planner's peak of one training step of this engine's model and config (None when no
    meta-device copy of the model can be had: pass ``meta_model``)."""
    if meta_model is None:
        cfg = getattr(engine.module, "config", None)
        if cfg is None or not type(engine.module).__module__.startswith("transformers."):
            return None
        meta_model = from_hf_config(cfg)
    plan = plan_one(meta_model, engine.config, world=engine.comm.world, micro_batch=micro_batch, seq_len=seq_len,
                    device=engine.device, rank=engine.comm.rank)
    return {"peak": plan.peak, "at_peak": plan.at_peak, "between": plan.between["total"] + plan.between["host_total"]}
