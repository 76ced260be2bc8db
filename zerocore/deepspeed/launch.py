"""``deepspeed.initialize`` and ``deepspeed.add_config_arguments`` with DeepSpeed 0.19's meanings."""
from __future__ import annotations

import argparse
import gc
import os
import warnings

import torch

from ..config import ConfigError, load_config
from ..config.parse import read_config_file
from .comm import init_distributed
from .config_checks import check_deepspeed_rules
from .semantics import prepare_config
from .tensor_overrides import lifted
from .utils.z3_leaf_module import apply_zero_leaf_module_config


class ModelRequired(ValueError, AssertionError):
    """initialize() without a model: DeepSpeed asserts it (an AssertionError), zerocore's errors are ValueErrors."""


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds DeepSpeed's command-line flags: ``--deepspeed`` (a flag for the script's own use) and
    ``--deepspeed_config`` (the JSON config file ``initialize(args=...)`` reads), plus their
    deprecated ``--deepscale`` spellings."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (a flag for user code; no effect on the engine)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help="Deprecated: --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated: --deepspeed_config")
    return parser


def _resolve_config(args, config, config_params):
    """DeepSpeed's order: ``config``, else ``config_params``; ``args.deepspeed_config`` (or the
    deprecated ``args.deepscale_config``) when neither is given; two sources at once are an error."""
    if config is None and config_params is not None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None)
    old = getattr(args, "deepscale_config", None)
    if old is not None:
        if from_args is not None:
            raise ValueError("zerocore.deepspeed.initialize: args has both deepspeed_config and deepscale_config; "
                             "give one (deepscale_config is deprecated)")
        from_args = old
    if from_args is not None:
        if config is not None:
            raise ValueError("zerocore.deepspeed.initialize: a config was given both in args.deepspeed_config "
                             f"({from_args!r}) and as config/config_params; give one")
        config = from_args
    if config is None:
        raise ValueError("zerocore.deepspeed.initialize: no config; pass config= (a dict or a JSON path) or "
                         "args with --deepspeed_config")
    return config


def _raw_dict(config) -> dict | None:
    """The config as the user wrote it (to see which sections they gave), or None for a ZeroConfig."""
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)):
        try:
            return read_config_file(os.fspath(config))  # HJSON too, where hjson is installed
        except ConfigError:
            return None  # zerocore's loader names the problem with the file
    return None


def _take_over(model: torch.nn.Module) -> None:
    """DeepSpeed wraps a model again when asked (a second engine over the model of a first; Transformers'
    Trainer does after an evaluation before training): here the engine holding the model gives it back
    first (``destroy(partitioned=True)``: hooks off, the trained values (training dtype) in the parameters,
    stage 3's still partitioned, as DeepSpeed's stay; a collective, as initialize is), with a warning;
    the old engine then refuses any use, naming destroy(). ``zerocore.initialize`` itself refuses such a
    model instead."""
    from ..runtime.gathered import owner_of

    def owners():
        found = {}
        for p in model.parameters():
            e = owner_of(p)
            if e is not None:
                found[id(e)] = e
        return list(found.values())

    held = owners()
    if held:
        gc.collect()  # an engine the script dropped may only wait for the collector
        held = owners()
    for old in held:
        warnings.warn(f"zerocore.deepspeed.initialize: the model belongs to a live engine (stage "
                      f"{old.zero_optimization_stage()}, {old.optimizer_steps} optimizer steps); it is destroyed and "
                      "its model, with its trained values, handed to the new engine (DeepSpeed wraps a model again)",
                      UserWarning, stacklevel=3)
        old.destroy(partitioned=True)


@lifted()  # inside zero.Init, torch's own constructors build the engine (DeepSpeed lifts its overrides too)
def initialize(args=None, model: torch.nn.Module | None = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port: int = 29500, mpu=None,
               dist_init_required: bool | None = None, collate_fn=None, config=None, mesh_param=None,
               config_params=None):
    """``deepspeed.initialize``: returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.
    ``optimizer`` is the engine's optimizer face (``engine.optimizer``), except at stage 0 without
    fp16/bf16, where DeepSpeed returns its basic optimizer and so does this: the client optimizer,
    or the FusedAdam built for the config's Adam section. It shares the engine's param_groups, and
    ``engine.step()`` makes the update with their values: do not call its ``step()`` yourself (with
    DeepSpeed that would be a second update too).

    ``optimizer``: a ``torch.optim.Optimizer``, or a callable taking ``model_parameters`` (the
    model's parameters when None) and returning one; with an ``optimizer`` section in the config
    too, the passed one is used (as DeepSpeed does; zerocore warns). ``training_data``: a torch Dataset, read through a loader over the
    data-parallel ranks as DeepSpeed's (``engine.training_dataloader``). ``mpu`` and
    ``mesh_param`` (model/sequence parallelism) are refused: zerocore is data parallel only.

    No ``optimizer`` and no ``optimizer`` section: as DeepSpeed, an engine for inference (a reference or
    evaluation model; TRL's ``prepare_deepspeed`` and Transformers' ``deepspeed_init(inference=True)`` make
    one): at stage 3 its parameters partitioned and gathered module by module, no optimizer state, the
    returned optimizer None, ``backward``/``step`` refused; stages 1 and 2 refuse it, as DeepSpeed asserts."""
    if model is None:
        raise ModelRequired("zerocore.deepspeed.initialize requires a model")
    if mpu is not None:
        raise ValueError("zerocore.deepspeed.initialize: mpu (a model-parallel unit) is not supported: zerocore "
                         "shards over data-parallel ranks only and cannot honour tensor/pipeline parallel groups; "
                         "pass mpu=None")
    if mesh_param is not None:
        raise ValueError("zerocore.deepspeed.initialize: mesh_param (sequence/data parallel mesh) is not supported; "
                         "pass mesh_param=None")
    config = _resolve_config(args, config, config_params)
    raw = _raw_dict(config)
    check_deepspeed_rules(raw)
    changed, semantics = prepare_config(raw)  # what DeepSpeed ignores here is dropped, with a warning
    # (a file read once: its dict goes on; a file that could not be read goes to the loader, which names why)
    cfg = load_config(changed if changed is not None else raw if raw is not None else config)
    if optimizer is not None:
        # with an optimizer section too, the passed optimizer is used (zerocore.initialize warns), as in DeepSpeed
        if not isinstance(optimizer, torch.optim.Optimizer):
            if not callable(optimizer) or isinstance(optimizer, type):
                raise TypeError(f"zerocore.deepspeed.initialize: optimizer must be a torch.optim.Optimizer or a "
                                f"callable taking the model parameters and returning one; got "
                                f"{type(optimizer).__name__}")
            params = model_parameters if model_parameters is not None else model.parameters()
            optimizer = optimizer(params)
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"zerocore.deepspeed.initialize: the optimizer callable returned a "
                                f"{type(optimizer).__name__}, not a torch.optim.Optimizer")
    if dist_init_required is not False:
        init_distributed(distributed_port=distributed_port)
    from ..runtime import initialize as zc_initialize

    # Without ZeRO and mixed precision DeepSpeed steps the basic optimizer itself and returns it: the
    # client's, or a FusedAdam it builds for an Adam section. So here: that FusedAdam becomes the
    # engine's client optimizer (zerocore steps it with the same kernel and values the section asks).
    plain = cfg.zero_optimization.stage == 0 and not cfg.fp16.enabled and not cfg.bf16.enabled
    if optimizer is None and plain and "optimizer" in cfg.given_sections:
        from .ops.adam import FusedAdam

        p = cfg.optimizer.params
        optimizer = FusedAdam(model_parameters if model_parameters is not None else
                              [q for q in model.parameters() if q.requires_grad], lr=p.lr, betas=tuple(p.betas),
                              eps=p.eps, weight_decay=p.weight_decay, adam_w_mode=cfg.optimizer.decoupled)
        cfg.given_sections = cfg.given_sections - {"optimizer"}  # the section's own optimizer: nothing to warn
    semantics.check_client_optimizer(optimizer, cfg)
    semantics.check_config(cfg)
    if optimizer is not None:
        model_parameters = None  # the optimizer's param_groups say what is trained, as in DeepSpeed
    frozen = optimizer is None and "optimizer" not in cfg.given_sections
    if frozen:  # DeepSpeed's engine without an optimizer: inference only (runtime/trains_nothing.py)
        model_parameters, lr_scheduler = _no_optimizer(cfg, model_parameters, lr_scheduler)
    _take_over(model)
    # DeepSpeed's engine flags the modules zero_optimization.leaf_module names (at any stage): the flags stay
    # on the model, where set_z3_leaf_modules' would (zerocore's stage 3 reads the section itself too)
    apply_zero_leaf_module_config(model, cfg.zero_optimization.leaf_module)
    engine = zc_initialize(model, cfg, model_parameters=model_parameters, optimizer=optimizer,
                           lr_scheduler=lr_scheduler, training_data=training_data, collate_fn=collate_fn,
                           frozen=frozen)
    semantics.attach(engine)
    returned = None if frozen else engine.optimizer.optimizer if plain else engine.optimizer
    return engine, returned, engine.training_dataloader, engine.lr_scheduler


class OptimizerRequired(ValueError, AssertionError):
    """ZeRO stage 1 or 2 without an optimizer: DeepSpeed asserts it (an AssertionError)."""


def _no_optimizer(cfg, model_parameters, lr_scheduler):
    """DeepSpeed given no optimizer and no ``optimizer`` section: at stages 1 and 2 an AssertionError
    ("zero stage N requires an optimizer"); at stages 0 and 3 an engine that trains nothing (stage 3:
    ``DeepSpeedZeRoOffload``, the parameters partitioned), which ignores ``model_parameters`` and a
    schedule, as DeepSpeed's does (said here). Returns them as the engine takes them: None."""
    stage = cfg.zero_optimization.stage
    if stage in (1, 2):
        raise OptimizerRequired(f"zerocore.deepspeed.initialize: zero stage {stage} requires an optimizer (as in "
                                "DeepSpeed): pass optimizer=..., or give the config an 'optimizer' section; without "
                                "one only stage 0 or 3 builds an engine, for inference")
    ignored = [name for name, value in (("model_parameters", model_parameters), ("lr_scheduler", lr_scheduler))
               if value is not None]
    if ignored:
        warnings.warn(f"zerocore.deepspeed.initialize: no optimizer and no 'optimizer' section: the engine trains "
                      f"nothing (inference, as DeepSpeed's) and {' and '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} "
                      "ignored", UserWarning, stacklevel=3)
    return None, None
