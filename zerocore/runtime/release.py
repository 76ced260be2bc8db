"""``engine.destroy()``: the engine gives its model back, so that another engine (or plain
torch) can use it. Hooks are removed (the gradient reducer's, stage 3's forward hooks and
module class swaps), gradient views are dropped, and every parameter gets its own tensor with
its full current value in the training dtype, taken from the flat buffers (gathered first at
stage 3, where each rank holds a chunk: a collective, as construction was). The fp32 master and
the optimizer moments are released; save them with the checkpoint methods first if needed.

Frozen parameters that stage 3 partitioned are given back whole the same way.

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
def release(engine, collective: bool = True) -> None:
    if engine.gatherer is not None and collective:
        engine.gatherer.free_all()
    full = [full_flat(engine, g, shard, engine.dtype) if collective or not g.partitioned else None
            for g, shard in zip(engine.groups, engine.shards)]
    frozen = engine.frozen_groups  # stage 3's partitioned frozen parameters
    full += [frozen_flat(engine, g) if collective else None for g in frozen]
    engine.reducer.remove_hooks()
    ds_param_attrs.detach(engine.module.parameters())  # stage 3: their own classes back
    if engine.gatherer is not None:
        engine.gatherer.remove_hooks()
        _unswap_classes(engine.module)
    for g, flat in zip(engine.groups + frozen, full):
        for p, s in zip(g.params, g.layout.slots):
            if flat is None:
                setattr(p, LOST, True)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            else:
                p.data = flat[s.offset:s.end].view(s.shape).clone()
            p.grad = None
    give_back_module_zero_grad(engine.module)
    unregister_engine(engine)
    engine.param_index = {}
    engine.groups, engine.shards, engine.frozen_groups = [], [], []


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
