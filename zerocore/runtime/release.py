"""``engine.destroy()``: the engine gives its model back, so that another engine (or plain
torch) can use it. Hooks are removed (the gradient reducer's, stage 3's forward hooks and
module class swaps), gradient views are dropped, and every parameter gets its own tensor with
its full current value in the training dtype, taken from the flat buffers (gathered first at
stage 3, where each rank holds a chunk: a collective, as construction was). The fp32 master and
the optimizer moments are released; save them with the checkpoint methods first if needed.

Frozen parameters that stage 3 partitioned are given back whole the same way.

``destroy(partitioned=True)`` gives a stage-3 model back partitioned instead, as ``zerocore.init``
leaves a model it built: each partitioned parameter the empty tensor, its rank's chunk of its value
(training dtype) in ``param._zc_init``; ``zerocore.initialize`` adopts it as it adopts a model built
under ``zerocore.init``. One group is whole at a time while the chunks are cut, so a model larger
than one rank's memory can go from an engine to the next (DeepSpeed's Trainer path builds an
inference engine for an evaluation before training, then the training engine over the same
partitioned parameters). Parameters kept whole (persistent, small) are given back whole.

Leaving a ``with`` block on an exception releases without collectives (the other ranks may not
be there): stage-3 parameters that only exist as chunks then stay empty, and are marked so that
``zerocore.initialize`` refuses them by name instead of building 0-element groups.
"""
from __future__ import annotations

import torch

from ..sharding.group import LOST_VALUES
from . import ds_param_attrs
from .gathered import unregister_engine
from .misuse import give_back_module_zero_grad
from .partition_init import InitShard, chunk_numel, cut_chunk
from .weights import _full_flat as full_flat, frozen_flat


LOST = LOST_VALUES  # set on a parameter whose values were dropped with its engine (sharding/group.py)
DESTROYED = ("zerocore: this engine was destroyed (engine.destroy()) and its memory released; build a new one "
             "with zerocore.initialize(model, config)")


class EngineDestroyed(AttributeError, RuntimeError):
    """Use of an engine after ``destroy()``. An AttributeError too: its state is gone, so
    ``getattr(engine, name, default)`` and ``hasattr`` answer as for any missing attribute."""


# What a destroyed engine keeps: its counters and config (small, and what a script may print after
# training), and ``module`` (None: the model was given back).
_KEPT = ("config", "micro_steps", "global_steps", "_optimizer_steps", "_skipped_steps", "_grad_norm")


@torch.no_grad()
def release(engine, collective: bool = True, partitioned: bool = False) -> None:
    if engine.gatherer is not None and collective:
        engine.gatherer.free_all()
    comm = engine.comm
    groups = [(g, shard) for g, shard in zip(engine.groups, engine.shards)]
    groups += [(g, None) for g in engine.frozen_groups]  # stage 3's partitioned frozen parameters
    values = []  # per group: its whole flat buffer, its parameters' chunks (partitioned), or None (lost)
    for g, shard in groups:
        if not collective and (shard is None or g.partitioned):
            values.append(None)
            continue
        flat = frozen_flat(engine, g) if shard is None else full_flat(engine, g, shard, engine.dtype)
        if partitioned and g.partitioned:  # cut now: one group is whole at a time
            values.append([_chunk_of(flat[s.offset:s.end], comm) for s in g.layout.slots])
        else:
            values.append(flat)
    engine.reducer.remove_hooks()
    ds_param_attrs.detach(engine.module.parameters())  # stage 3: their own classes back
    if engine.gatherer is not None:
        engine.gatherer.remove_hooks()
        _unswap_classes(engine.module)
    owners = _owner_names(engine.module) if partitioned else {}
    for (g, _), value in zip(groups, values):
        for i, (p, s) in enumerate(zip(g.params, g.layout.slots)):
            if value is None:
                setattr(p, LOST, True)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            elif isinstance(value, list):
                chunk = value[i]
                p.data = torch.empty(0, dtype=chunk.dtype, device=chunk.device)
                p._zc_init = InitShard(s.shape, chunk, comm.world, p._version, owners.get(id(p), "?"),
                                       made="when its engine was destroyed with partitioned=True")
                ds_param_attrs.mark_init(p)
            else:
                p.data = value[s.offset:s.end].view(s.shape).clone()
            p.grad = None
    give_back_module_zero_grad(engine.module)
    unregister_engine(engine)
    engine.param_index = {}
    engine.groups, engine.shards, engine.frozen_groups = [], [], []


def _chunk_of(value: torch.Tensor, comm) -> torch.Tensor:
    """This rank's chunk of a parameter's flattened ``value``, as ``zerocore.init`` cuts it."""
    chunk = torch.empty(chunk_numel(value.numel(), comm.world), dtype=value.dtype, device=value.device)
    cut_chunk(value, chunk, comm.rank)
    return chunk


def _owner_names(module: torch.nn.Module) -> dict:
    """id(parameter) -> the class name of the module registering it (``zerocore.init``'s messages name it)."""
    return {id(q): type(m).__name__ for m in module.modules() for q in m._parameters.values() if q is not None}


def _unswap_classes(module: torch.nn.Module) -> None:
    """Undoes the gatherer's per-instance class swap (parameter-access hook)."""
    for m in module.modules():
        if m.__dict__.pop("_zc_gatherer", None) is not None and getattr(type(m), "_zc_access_hooked", False):
            m.__class__ = type(m).__mro__[1]


def forget_state(engine) -> None:
    """The end of ``destroy()``: the engine drops every reference it holds (groups, shards, reducer,
    gatherer, offload plan, optimizer face, schedule, checkpoint buffers), so every buffer it owned is
    freed now by reference counting even while the engine object itself stays referenced (a Trainer,
    a notebook, a closure). Any later use raises :class:`EngineDestroyed`, naming ``destroy()``."""
    kept = {k: engine.__dict__[k] for k in _KEPT if k in engine.__dict__}
    engine.__dict__.clear()
    engine.__dict__.update(kept, module=None, _destroyed=True)
