"""ColossalAI 0.0.x's config form -> zerocore's keys, so that it means what it says:

    optimizer = dict(type='Adam', lr=0.001, weight_decay=0)
    zero = dict(type='ZeroRedundancyOptimizer_Level_3', dynamic_loss_scale=True, clip_grad=1.0,
                offload_optimizer_config=dict(device='cpu', pin_memory=True, fast_init=True),
                offload_param_config=dict(device='nvme', max_in_cpu=..., nvme_path=...))

- ``zero`` is ``zero_optimization``; in it ``level`` is ``stage`` and ``offload_*_config`` are
  the ``offload_*`` sections;
- ``zero.type`` ``ZeroRedundancyOptimizer_Level_N`` -> ``zero_optimization.stage`` N;
- optimizer hyper-parameters given flat -> ``optimizer.params``; in that form ``type='Adam'`` is
  ``torch.optim.Adam`` (what ColossalAI builds from it): L2 decay, ``adam_w_mode`` false;
- ``dynamic_loss_scale`` -> fp16 with dynamic loss scaling, ``static_loss_scale`` -> fp16 with
  that scale, ``dynamic_loss_args`` -> the fp16 section's knobs;
- ``clip_grad`` -> ``gradient_clipping``; ``gradient_accumulation_steps`` inside ``zero`` moves
  to the top level;
- ``partition_grads: true`` (Level_2 always partitions gradients) is accepted, any other value is
  an error.

A translated key that contradicts a key given in DeepSpeed's spelling is an error naming both.
``offload_param_config`` has no ``fast_init`` (``offload_optimizer_config``'s is a bool), but a
number written there is most likely the host-memory bound (``max_in_cpu``) in the wrong place:
it is taken as ``max_in_cpu`` with a warning that says so; a bool there is an error.
"""
from __future__ import annotations

import math
import re
from typing import Any

from ..options import ConfigError
from .translation import Translation, drop_accepted, rename_at

# section path -> {ColossalAI's spelling: zerocore's key}
ALIASES: dict[str, dict[str, str]] = {
    "": {"zero": "zero_optimization"},
    "zero_optimization": {"level": "stage", "offload_optimizer_config": "offload_optimizer",
                          "offload_param_config": "offload_param"},
}
# section path -> key -> (values zerocore honours, what zerocore does)
ACCEPTED: dict[str, dict[str, tuple]] = {
    "zero_optimization": {
        "partition_grads": ((True,), "ColossalAI's Level_2 always partitions gradients; for whole gradients "
                                     "use stage 1"),
    },
}

_LEVEL = re.compile(r"^ZeroRedundancyOptimizer_Level_([123])$", re.IGNORECASE)
_ZERO_KEYS = ("zero_optimization", "zero")
# ColossalAI / DeepSpeed dynamic_loss_args -> the fp16 section's keys
_LOSS_ARGS = {"scale_window": "loss_scale_window", "delayed_shift": "hysteresis",
              "consecutive_hysteresis": "consecutive_hysteresis", "min_scale": "min_loss_scale"}


def translate(data: dict) -> Translation:
    """``data`` with ColossalAI's keys written as zerocore's (keys it does not know are left for
    the DeepSpeed translator and the schema)."""
    notes: list[str] = []
    data = dict(data)
    present = [k for k in _ZERO_KEYS if k in data]
    if len(present) == 1 and isinstance(data[present[0]], dict):
        zkey = present[0]  # messages name the section as the user wrote it
        z = dict(data[zkey])
        _zero_type(z, zkey)
        _loss_scaling(data, z, zkey)
        _move_up(data, z, zkey, "clip_grad", "gradient_clipping")
        _move_up(data, z, zkey, "gradient_accumulation_steps", "gradient_accumulation_steps")
        _param_fast_init(z, zkey, notes)
        data[zkey] = z
    if isinstance(data.get("optimizer"), dict):
        data["optimizer"] = _flat_optimizer(data["optimizer"])
    for path, names in ALIASES.items():
        data = rename_at(data, path, names)
    return Translation(drop_accepted(data, ACCEPTED), notes=tuple(notes))


def _zero_type(z: dict, zkey: str) -> None:
    if "type" not in z:
        return
    value = z.pop("type")
    m = _LEVEL.match(value) if isinstance(value, str) else None
    if m is None:
        raise ConfigError(f"{zkey}.type: got {value!r}; allowed: 'ZeroRedundancyOptimizer_Level_1', "
                          "'ZeroRedundancyOptimizer_Level_2', 'ZeroRedundancyOptimizer_Level_3' (or give "
                          f"{zkey}.stage)")
    stage = int(m.group(1))
    for other in ("stage", "level"):
        if other in z and z[other] != stage:
            raise ConfigError(f"{zkey}.type: {value!r} means stage {stage} but {zkey}.{other} is {z[other]!r}; "
                              "give one of them")
    if "level" not in z:
        z["stage"] = stage


def _loss_scaling(data: dict, z: dict, zkey: str) -> None:
    dynamic = z.pop("dynamic_loss_scale", None)
    static = z.pop("static_loss_scale", None)
    args = z.pop("dynamic_loss_args", None)
    if dynamic is None and static is None and args is None:
        return
    if dynamic is not None and not isinstance(dynamic, bool):
        raise ConfigError(f"{zkey}.dynamic_loss_scale: got {dynamic!r}; allowed: true or false")
    fp16: dict[str, Any] = {}
    if dynamic:
        fp16 = {"enabled": True, "loss_scale": 0}
        if static is not None and static != 1:  # 1.0 is ColossalAI's default, unused when dynamic
            raise ConfigError(f"{zkey}.static_loss_scale: got {static!r} together with dynamic_loss_scale: true; "
                              "give one of them")
    elif static is not None:
        if isinstance(static, bool) or not isinstance(static, (int, float)) or not math.isfinite(static) \
                or static <= 0:
            raise ConfigError(f"{zkey}.static_loss_scale: got {static!r}; allowed: a number > 0")
        fp16 = {"enabled": True, "loss_scale": float(static)}
    if args is not None:
        if not dynamic:
            raise ConfigError(f"{zkey}.dynamic_loss_args: given without dynamic_loss_scale: true")
        fp16.update(_loss_args(args, zkey))
    if not fp16:  # dynamic_loss_scale: false alone asks for nothing
        return
    given = data.get("fp16")
    if given is not None and not isinstance(given, dict):
        return  # the parser names the bad fp16 section
    given = dict(given or {})
    for key, value in fp16.items():
        if key in given and given[key] != value:
            raise ConfigError(f"{zkey}.dynamic_loss_scale/static_loss_scale ask for fp16.{key}={value!r} but "
                              f"fp16.{key} is {given[key]!r}; give one of them")
        given[key] = value
    bf16 = data.get("bf16") or data.get("bfloat16")
    if isinstance(bf16, dict) and bf16.get("enabled"):
        raise ConfigError(f"{zkey}.dynamic_loss_scale/static_loss_scale: loss scaling is fp16's, but bf16.enabled "
                          "is true; remove one of them")
    data["fp16"] = given


def _loss_args(args: Any, zkey: str) -> dict:
    if not isinstance(args, dict):
        raise ConfigError(f"{zkey}.dynamic_loss_args: got {type(args).__name__}; allowed: a dict")
    out = {}
    for key, value in args.items():
        if key == "init_scale":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1 \
                    or not math.isfinite(value) or 2 ** round(math.log2(value)) != value:
                raise ConfigError(f"{zkey}.dynamic_loss_args.init_scale: got {value!r}; allowed: a power of 2 >= 1 "
                                  "(fp16.initial_scale_power is its exponent)")
            out["initial_scale_power"] = round(math.log2(value))
        elif key in _LOSS_ARGS:
            out[_LOSS_ARGS[key]] = value
        else:
            raise ConfigError(f"{zkey}.dynamic_loss_args.{key}: unknown; allowed keys: init_scale, "
                              + ", ".join(_LOSS_ARGS))
    return out


def _move_up(data: dict, z: dict, zkey: str, key: str, top: str) -> None:
    if key not in z:
        return
    value = z.pop(key)
    if top in data and data[top] != value:
        raise ConfigError(f"{zkey}.{key}: got {value!r} but {top} is {data[top]!r}; give one of them")
    data[top] = value


def _param_fast_init(z: dict, zkey: str, notes: list[str]) -> None:
    for sec in ("offload_param", "offload_param_config"):
        p = z.get(sec)
        if not isinstance(p, dict) or "fast_init" not in p:
            continue
        p = dict(p)
        value = p.pop("fast_init")
        key = f"{zkey}.{sec}.fast_init"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: got {value!r}; offload_param has no fast_init (offload_optimizer's fast_init "
                              "is the bool); remove it, or give the host memory bound as max_in_cpu")
        if "max_in_cpu" in p:
            raise ConfigError(f"{key}: got {value!r} and max_in_cpu {p['max_in_cpu']!r}; offload_param has no "
                              "fast_init: remove it")
        p["max_in_cpu"] = value
        notes.append(f"{key}={value!r} taken as {zkey}.{sec}.max_in_cpu={value!r} (offload_param has no fast_init, "
                     "and a number there reads as the host-memory bound of the parameter shards): write max_in_cpu")
        z[sec] = p


def _flat_optimizer(opt: dict) -> dict:
    flat = {k: v for k, v in opt.items() if k not in ("type", "params")}
    if not flat:
        return opt
    params = opt.get("params")
    if params is not None and not isinstance(params, dict):
        return opt  # the parser names the bad params section
    params = dict(params or {})
    for key, value in flat.items():
        if key in params and params[key] != value:
            raise ConfigError(f"optimizer.{key}: got {value!r} but optimizer.params.{key} is {params[key]!r}; "
                              "give one of them")
        params[key] = value
    if isinstance(opt.get("type"), str) and opt["type"].lower() == "adam":
        params.setdefault("adam_w_mode", False)  # ColossalAI's type='Adam' is torch.optim.Adam: L2 decay
    out = {"params": params}
    if "type" in opt:
        out["type"] = opt["type"]
    return out
