"""What every integration needs from the engine: build it from a client torch optimizer, feed it
the learning rate the trainer's scheduler set, back-propagate a loss the trainer already divided
for accumulation, and check the client library's version."""
from __future__ import annotations

import copy
import inspect
from importlib import metadata

import torch

import zerocore

# torch optimizers whose update is the engine's fused Adam: type name -> (config type, decoupled decay)
_ADAM_LIKE = {"AdamW": ("AdamW", True), "Adam": ("Adam", False), "FusedAdam": ("AdamW", True)}
_HYPER = ("lr", "betas", "eps", "weight_decay")


def check_version(dist_name: str, lowest: str, below: str, what: str) -> str:
    """The installed ``dist_name`` version; an ImportError naming the supported range when outside it."""
    try:
        installed = metadata.version(dist_name)
    except metadata.PackageNotFoundError as e:
        raise ImportError(f"{what} needs {dist_name} (supported: >={lowest},<{below}); it is not installed") from e
    if not (_parse(lowest) <= _parse(installed) < _parse(below)):
        raise ImportError(f"{what} supports {dist_name} >={lowest},<{below}; installed is {installed}")
    return installed


def _parse(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def optimizer_section(optimizer: torch.optim.Optimizer) -> tuple[dict, list[dict]]:
    """The config ``optimizer`` section equal to a client Adam/AdamW, and its parameter groups
    (the trainable parameters each group holds, with that group's hyperparameters)."""
    name = type(optimizer).__name__
    if name not in _ADAM_LIKE:
        raise ValueError(f"zerocore: the trainer's optimizer is {type(optimizer).__module__}.{name}; this zerocore "
                         f"steps Adam/AdamW with its fused kernel (use an AdamW optimizer, e.g. TrainingArguments("
                         f"optim='adamw_torch'), or an 'optimizer' section in the zerocore config)")
    cfg_type, decoupled = _ADAM_LIKE[name]
    if name == "FusedAdam":
        decoupled = bool(getattr(optimizer, "adam_w_mode", True))
    groups = [g for g in optimizer.param_groups if any(p.requires_grad for p in g["params"])]
    if not groups:
        raise ValueError("zerocore: the optimizer holds no trainable parameter")
    first = groups[0]
    params = {"lr": float(first["lr"]), "betas": [float(b) for b in first["betas"]], "eps": float(first["eps"]),
              "weight_decay": float(first["weight_decay"])}
    if not decoupled:
        params["adam_w_mode"] = False
    return {"type": cfg_type, "params": params}, groups


def initialize(model: torch.nn.Module, config: dict, groups: list[dict] | None = None, frozen: bool = False):
    """``zerocore.initialize`` with the trainer's parameter groups: passed on where the engine takes
    ``model_parameters``; otherwise every group must share one set of hyperparameters (the
    parameters outside every group are frozen either way). ``frozen``: an engine that trains
    nothing (no groups then)."""
    if frozen:
        return zerocore.initialize(model, config, frozen=True)
    if groups is not None:
        in_groups = {id(p) for g in groups for p in g["params"]}
        for name, p in model.named_parameters():
            if p.requires_grad and id(p) not in in_groups:
                raise ValueError(f"zerocore: parameter {name!r} is trainable but in no optimizer group; freeze it "
                                 "(requires_grad_(False)) or add it to the optimizer")
        if "model_parameters" in inspect.signature(zerocore.initialize).parameters:
            return zerocore.initialize(model, config, model_parameters=[
                {k: v for k, v in g.items() if k == "params" or k in _HYPER} for g in groups])
        first = {k: groups[0][k] for k in _HYPER}
        for i, g in enumerate(groups[1:], 1):
            diff = [k for k in _HYPER if _norm(g[k]) != _norm(first[k])]
            if diff:
                raise ValueError(
                    f"zerocore: optimizer group {i} differs from group 0 in {', '.join(diff)} "
                    f"({', '.join(f'{k}={g[k]} vs {first[k]}' for k in diff)}); this zerocore build has one set of "
                    "hyperparameters for all parameters (with the Hugging Face Trainer, weight_decay > 0 makes a "
                    "no-decay group for biases and norms: set weight_decay=0, or use a zerocore with parameter "
                    "groups)")
    return zerocore.initialize(model, config)


def evaluation_config(config: dict) -> dict:
    """A trainer's zerocore config for an engine that trains nothing (an evaluation, a reference or reward
    model): a copy without the ``optimizer`` and ``scheduler`` sections and ``offload_optimizer``, as TRL's
    ``prepare_deepspeed`` and Transformers' inference engine drop them."""
    cfg = copy.deepcopy(config)
    cfg.pop("optimizer", None)
    cfg.pop("scheduler", None)
    z = cfg.get("zero_optimization")
    if isinstance(z, dict):
        z.pop("offload_optimizer", None)
    return cfg


def compile_as_accelerate(engine, accelerator) -> None:
    """Accelerate's ``torch.compile`` setting (its ``TorchDynamoPlugin``: ``Accelerator(dynamo_backend=...)``, the
    Trainer's ``torch_compile``, ``torch_compile_backend``, ``torch_compile_mode``) applied as its DeepSpeed route
    applies it: ``engine.compile(backend, compile_kwargs)``. The plugin's regional compilation is what the engine
    does at stage 3 anyway (each unit's forward one graph); below stage 3 the whole module is compiled."""
    plugin = getattr(getattr(accelerator, "state", None), "dynamo_plugin", None)
    if plugin is None:
        return
    kwargs = plugin.to_kwargs()  # the settings that differ from the plugin's defaults, the backend a name
    backend = str(kwargs.pop("backend", plugin.to_dict()["backend"]))
    kwargs.pop("use_regional_compilation", None)
    if backend != "no":
        engine.compile(backend=backend, compile_kwargs=kwargs)


def _norm(v):
    return tuple(float(x) for x in v) if isinstance(v, (list, tuple)) else float(v)


def sync_lr(engine, optimizer: torch.optim.Optimizer) -> None:
    """Gives the engine the learning rate(s) the trainer's scheduler wrote into ``optimizer``."""
    face = getattr(engine, "optimizer", None)
    if face is not None and hasattr(face, "param_groups"):
        if face is not optimizer:
            for dst, src in zip(face.param_groups, optimizer.param_groups):
                dst["lr"] = src["lr"]
        return
    lrs = {float(g["lr"]) for g in optimizer.param_groups if g["params"]}
    if len(lrs) > 1:
        raise ValueError(f"zerocore: the optimizer groups have different learning rates {sorted(lrs)}; this zerocore "
                         "build has one learning rate for all parameters")
    engine.lr = lrs.pop()


def accepts(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def backward_divided(engine, loss: torch.Tensor) -> None:
    """Back-propagates a loss the trainer already divided by its accumulation steps (the engine's
    own ``backward`` divides by them too)."""
    if accepts(engine.backward, "scale_wrt_gas"):
        engine.backward(loss, scale_wrt_gas=False)
    else:
        engine.backward(loss * engine.gas)


def backward_at(engine, loss: torch.Tensor, boundary: bool, *, divided: bool) -> None:
    """Back-propagates one micro-batch, the trainer saying whether it ends the accumulation window.

    Trainers end an epoch's last window early when the epoch's micro-batches per rank are not a
    multiple of the accumulation steps, and update there; the engine's own counter would end that
    window elsewhere and shift every later one by the remainder. So the trainer's
    boundary overrides the counter, as Accelerate's DeepSpeed wrapper does. ``divided``: the
    trainer already divided the loss for accumulation (its own rule for a short window); else the
    engine divides by ``gradient_accumulation_steps``, as Accelerate does on DDP, a short window too."""
    engine.set_gradient_accumulation_boundary(bool(boundary))
    if divided:
        backward_divided(engine, loss)
    else:
        engine.backward(loss)


def global_grad_norm(engine) -> float | None:
    get = getattr(engine, "get_global_grad_norm", None)
    return get() if callable(get) else engine.global_grad_norm


class EngineOptimizer(torch.optim.Optimizer):
    """The optimizer a trainer holds: ``param_groups`` with each group's hyperparameters (the
    trainer's scheduler writes ``lr`` there; the engine reads it at each update), and ``step`` /
    ``zero_grad`` that do nothing: the engine updates and clears at its accumulation boundary."""

    def __init__(self, groups: list[dict]):
        # the group dicts themselves, not copies: a scheduler built over the trainer's own
        # optimizer writes the lr this face (and so the engine) reads
        super().__init__(list(groups), {})

    def step(self, closure=None):
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass
