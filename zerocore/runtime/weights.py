"""Full weights out of a sharded engine: ``full_state_dict`` (fp32, every rank) and DeepSpeed's
``save_16bit_model`` (training dtype, written by rank 0). Both are collectives."""
from __future__ import annotations

import os

import torch

from ..comm.divergence import Op
from ..sharding import ParamState


@torch.no_grad()
def full_state_dict(engine, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Full weights as CPU tensors of ``dtype`` (fp32: from the fp32 master; the training dtype:
    from the 16-bit parameters) under the model's own names, every name of a tied weight."""
    full: dict[int, torch.Tensor] = {}
    for g, shard in zip(engine.groups, engine.shards):
        flat = _full_flat(engine, g, shard, dtype)
        for p, s in zip(g.params, g.layout.slots):
            full[id(p)] = flat[s.offset:s.end].view(s.shape).to("cpu", copy=True)
    for g in engine.frozen_groups:  # stage 3's partitioned frozen parameters, in the training dtype
        flat = frozen_flat(engine, g)
        for p, s in zip(g.params, g.layout.slots):
            full[id(p)] = flat[s.offset:s.end].view(s.shape).to("cpu", dtype, copy=True)
    out = {}
    for name, t in engine.module.state_dict(keep_vars=True).items():
        if id(t) in full:
            out[name] = full[id(t)]
        else:  # frozen parameters and buffers: whole on every rank
            out[name] = t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype, copy=True)
    return out


def _full_flat(engine, g, shard, dtype: torch.dtype) -> torch.Tensor:
    """One group's whole flat buffer in ``dtype`` on this rank (gathering what it lacks)."""
    comm = engine.comm
    master_wanted = dtype == torch.float32
    if not g.partitioned and (engine.dtype == dtype or not master_wanted):
        # the parameters are whole here (stages 0-2, persistent ones); converting is local
        g.param_state.expect(ParamState.GATHERED)
        return g.param_flat.to(dtype)
    if not engine.policy.shard_optimizer:
        return shard.master  # stage 0: the whole master is here
    engine.guard.check(Op.CONTEXT, g.index, 0)
    mine = shard.master if master_wanted else g.owned_params()
    flat = torch.empty(g.layout.padded, dtype=mine.dtype, device=mine.device)
    comm.all_gather_into(flat, mine.contiguous())
    return flat.to(dtype)


def frozen_flat(engine, g) -> torch.Tensor:
    """A frozen group's whole flat buffer (training dtype, on the training device), gathered from
    every rank's chunk (a collective), whatever state the group is in."""
    engine.guard.check(Op.CONTEXT, g.index, 0)
    flat = torch.empty(g.layout.padded, dtype=g.layout.dtype, device=g.param_flat.device)
    engine.comm.all_gather_into(flat, g.owned_params().to(flat.device))  # a host-resident chunk: to the device first
    return flat


def save_16bit_model(engine, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
    z = engine.config.zero_optimization
    if z.stage == 3 and not z.stage3_gather_16bit_weights_on_model_save:
        raise RuntimeError("zerocore: save_16bit_model at stage 3 needs "
                           "zero_optimization.stage3_gather_16bit_weights_on_model_save: true (it gathers the "
                           "full weights onto every rank's memory, one group at a time); or use "
                           "engine.full_state_dict() for fp32 weights")
    state = full_state_dict(engine, engine.dtype)
    if engine.comm.rank != 0:
        return False
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, save_filename)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        torch.save(state, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: a crash leaves the old file or the new one, never half of one
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return True
