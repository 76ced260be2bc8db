"""Hyper-parameter groups: which trainable parameters share lr, betas, eps and weight decay.

Given as ``model_parameters`` (an iterable of parameters, or a list of dicts each with
``params`` and any of the optimizer's per-group keys) or read from a client optimizer's
``param_groups``. Parameters of the model in no group are not trained: they keep their
``requires_grad`` but get no optimizer state and no update (DeepSpeed's behaviour). A group's
missing keys take the optimizer's defaults (the config's ``optimizer.params``, or the client
optimizer's ``defaults``).

The engine keeps the groups apart in its flat buffers (``group_specs.py``), so each optimizer
call reads one set of hyper-parameters.
"""
from __future__ import annotations

import dataclasses
import math

import torch

# Keys a group may carry whatever the optimizer: a label, and what torch's LRScheduler adds.
HARMLESS_KEYS = ("name", "initial_lr")


@dataclasses.dataclass
class ResolvedGroups:
    groups: list[dict]  # {"params": [Parameter, ...], every option key}: the optimizer face's param_groups
    index: dict[int, int]  # id(trainable parameter) -> its group
    ungrouped: list  # (names, parameter): requires_grad parameters of the model that no group holds


def _where(source: str, i: int) -> str:
    return f"{source}[{i}]"


def _params_of(value, where: str) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (set, frozenset)):
        raise TypeError(f"zerocore: {where}['params'] is a set, whose order changes between runs (and ranks); "
                        "give a list")
    try:
        out = list(value)
    except TypeError:
        raise TypeError(f"zerocore: {where}['params']: got {type(value).__name__}; allowed: a parameter or a list "
                        "of parameters") from None
    for p in out:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"zerocore: {where}['params'] holds a {type(p).__name__}; allowed: parameters of the "
                            "model")
    return out


def _as_group_dicts(model_parameters, source: str) -> list[dict]:
    items = list(model_parameters)
    if not items:
        raise ValueError(f"zerocore: {source} is empty: no parameter to train")
    if all(isinstance(x, dict) for x in items):
        return [dict(x) for x in items]
    if any(isinstance(x, dict) for x in items):
        raise TypeError(f"zerocore: {source} mixes parameters and group dicts; give either a list of parameters or "
                        "a list of dicts with 'params'")
    return [{"params": items}]


def check_value(key: str, value, where: str):
    """A per-group Adam hyper-parameter, checked like the config's (named in the error)."""
    def bad(allowed):
        return ValueError(f"zerocore: {where}['{key}']: got {value!r}; allowed: {allowed}")

    if key == "betas":
        if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(
                isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in value):
            raise bad("two numbers in [0, 1)")
        return (float(value[0]), float(value[1]))
    if key in ("lr", "eps", "weight_decay"):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise bad("a finite number >= 0")
        return float(value)
    return value


def resolve(module: torch.nn.Module, model_parameters, defaults: dict, *, source: str = "model_parameters",
            checked=("lr", "betas", "eps", "weight_decay")) -> ResolvedGroups:
    """The groups over ``module``'s parameters. ``model_parameters`` None: one group of every
    parameter that requires grad. ``defaults``: the values of keys a group leaves out (and the
    keys a group may have, with ``HARMLESS_KEYS``). ``checked``: keys validated as Adam's."""
    names: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    if model_parameters is None:
        seen, params = set(), []
        for p in module.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        model_parameters = [{"params": params}]
    elif isinstance(model_parameters, (torch.Tensor, dict)):
        model_parameters = [model_parameters]
    groups = _as_group_dicts(model_parameters, source)
    allowed = set(defaults) | set(HARMLESS_KEYS) | {"params"}
    index: dict[int, int] = {}
    owner: dict[int, int] = {}
    out = []
    for i, g in enumerate(groups):
        where = _where(source, i)
        if "params" not in g:
            raise ValueError(f"zerocore: {where} has no 'params' key; each group is a dict with 'params' (a list of "
                             "parameters) and optional per-group options")
        for key in g:
            if key not in allowed:
                raise ValueError(f"zerocore: {where}: unknown key '{key}'; a group may set "
                                 f"{', '.join(sorted(allowed - {'params'}))}")
        params = _params_of(g["params"], where)  # may be empty (weight-decay grouping makes such groups): kept,
        # as torch and DeepSpeed keep it, so its index and lr stay where the user's schedules expect them
        for p in params:
            if id(p) not in names:
                raise ValueError(f"zerocore: {where}['params'] holds a tensor of shape {tuple(p.shape)} that is not a "
                                 "parameter of the model passed to initialize")
            if id(p) in owner:
                j = owner[id(p)]
                raise ValueError(f"zerocore: parameter '{names[id(p)][0]}' is in two groups: {_where(source, j)} and "
                                 f"{where}; a parameter may be in one group only")
            owner[id(p)] = i
            if p.requires_grad:
                index[id(p)] = i
        group = {**defaults, **{k: v for k, v in g.items() if k != "params"}}
        for key in checked:
            if key in group:
                group[key] = check_value(key, group[key], where)
        group["params"] = params
        out.append({"params": group.pop("params"), **group})
    ungrouped = []
    seen = set()
    for n, p in module.named_parameters(remove_duplicate=False):
        if p.requires_grad and id(p) not in owner and id(p) not in seen:
            seen.add(id(p))
            ungrouped.append((tuple(names[id(p)]), p))
    if not index:
        raise ValueError(f"zerocore: {source} holds no parameter that requires grad: nothing to train")
    return ResolvedGroups(out, index, ungrouped)
