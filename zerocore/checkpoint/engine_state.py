"""The engine's small state beside the sharded tensors, kept in the manifest: every
hyper-parameter group's values (lr, betas, eps, weight decay and the other numbers a client
optimizer's groups carry), the lr schedule's ``state_dict()`` (pickled, base64: a schedule's
state may hold tuples or tensors that JSON would change), and with a client torch optimizer
(``runtime/torch_shard_step.py``) its class, the names of its per-element state tensors
(``kinds``: the columns of every chunk, after ``master``) and its scalar state per group."""
from __future__ import annotations

import base64
import io
import warnings

import torch

from .manifest import KINDS


def _b64(obj) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _unb64(text: str):
    return torch.load(io.BytesIO(base64.b64decode(text)), weights_only=False)


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
    sched = None if engine.lr_scheduler is None else _b64(engine.lr_scheduler.state_dict())
    out = {"param_groups": groups, "lr_scheduler": sched}
    ts = engine._torch_step
    if ts is not None:
        out.update(kinds=["master"] + ts.kinds(), optimizer=ts.client_name, optimizer_scalars=_b64(ts.scalars()))
    else:
        out.update(kinds=list(KINDS), optimizer="Adam")
    return out


def kinds_to_read(engine, manifest: dict, with_state: bool) -> tuple[str, ...]:
    """The state kinds this load reads (the rest of the engine's state starts from zero)."""
    saved = manifest.get("kinds", list(KINDS))
    ts = engine._torch_step
    same = manifest.get("optimizer", "Adam") == ("Adam" if ts is None else ts.client_name)
    if not with_state or not same:
        if with_state:
            warnings.warn(f"zerocore checkpoint: saved with optimizer {manifest.get('optimizer', 'Adam')}, loaded with "
                          f"{'Adam' if ts is None else ts.client_name}: only the weights were loaded (the optimizer "
                          "state starts afresh)", UserWarning, stacklevel=4)
        if ts is not None:
            ts.load_kinds = []
        return ("master",)
    if ts is not None:
        ts.load_kinds = [k for k in saved if k != "master"]
    return tuple(saved)


def restore(engine, manifest: dict, load_lr_scheduler_states: bool, with_state: bool = True) -> None:
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
        engine.lr_scheduler.load_state_dict(_unb64(sched))
    ts = engine._torch_step
    if ts is not None:
        if with_state and ts.load_kinds is not None and manifest.get("optimizer_scalars") \
                and manifest.get("optimizer") == ts.client_name:
            ts.restore_scalars(_unb64(manifest["optimizer_scalars"]))
        ts.load_kinds = []
