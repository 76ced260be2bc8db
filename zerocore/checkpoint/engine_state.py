"""The engine's small state beside the sharded tensors, kept in the manifest: every
hyper-parameter group's values (lr, betas, eps, weight decay and the other numbers a client
optimizer's groups carry) and the lr schedule's ``state_dict()`` (pickled, base64: a schedule's
state may hold tuples or tensors that JSON would change)."""
from __future__ import annotations

import base64
import io
import warnings

import torch


def _plain(v):
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (list, tuple)) and all(isinstance(x, (bool, int, float)) for x in v):
        return list(v)
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    return None  # not a number: not saved


def saved(engine) -> dict:
    groups = [{k: _plain(v) for k, v in g.items() if k != "params" and _plain(v) is not None}
              for g in engine.optimizer.param_groups]
    sched = None
    if engine.lr_scheduler is not None:
        buf = io.BytesIO()
        torch.save(engine.lr_scheduler.state_dict(), buf)
        sched = base64.b64encode(buf.getvalue()).decode("ascii")
    return {"param_groups": groups, "lr_scheduler": sched}


def restore(engine, manifest: dict, load_lr_scheduler_states: bool) -> None:
    groups = manifest.get("param_groups")
    if groups is None:  # a checkpoint from before groups: one lr for everything
        for g in engine.optimizer.param_groups:
            g["lr"] = manifest["hyper"]["lr"]
    elif len(groups) != len(engine.optimizer.param_groups):
        warnings.warn(f"zerocore checkpoint: it has {len(groups)} hyper-parameter groups, the engine "
                      f"{len(engine.optimizer.param_groups)}; the groups' lr and other values were not restored",
                      UserWarning, stacklevel=4)
    else:
        for g, s in zip(engine.optimizer.param_groups, groups):
            for k, v in s.items():
                if k in g:
                    g[k] = tuple(v) if isinstance(g[k], tuple) else v
    sched = manifest.get("lr_scheduler")
    if load_lr_scheduler_states and engine.lr_scheduler is not None and sched is not None:
        state = torch.load(io.BytesIO(base64.b64decode(sched)), weights_only=False)
        engine.lr_scheduler.load_state_dict(state)
