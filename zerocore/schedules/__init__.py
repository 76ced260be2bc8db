"""Learning-rate schedules: torch ``LRScheduler`` objects over the engine's optimizer face.

- the config's ``scheduler`` section (``{"type": ..., "params": {...}}``): DeepSpeed's types
  (``deepspeed_types.py``) or, as DeepSpeed allows, the name of a scheduler class in
  ``torch.optim.lr_scheduler``; its params are checked against the class's signature when the
  config is read (an unknown or missing one is an error naming ``scheduler.params.<key>``);
- a client scheduler: an ``LRScheduler`` built over ``engine.optimizer``, or a callable taking
  the optimizer and returning one. A client scheduler wins over the config's section, as in
  DeepSpeed.

The engine steps the schedule once per accumulation boundary, not on a step skipped for fp16
overflow, and saves its ``state_dict()`` in checkpoints.
"""
from __future__ import annotations

import inspect
import warnings

import torch
from torch.optim.lr_scheduler import LRScheduler

from .deepspeed_types import (DEEPSPEED_SCHEDULES, WARMUP_TYPES, LRRangeTest, OneCycle, WarmupCosineLR,
                              WarmupDecayLR, WarmupLR)

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest", "DEEPSPEED_SCHEDULES",
           "schedule_class", "check_params", "from_config", "client_schedule"]


class ScheduleConfigError(ValueError):
    """A scheduler section that cannot be built (zerocore.ConfigError subclasses ValueError too)."""


def schedule_class(name: str):
    """The class a config's ``scheduler.type`` names."""
    if name in DEEPSPEED_SCHEDULES:
        return DEEPSPEED_SCHEDULES[name]
    cls = getattr(torch.optim.lr_scheduler, name, None)
    if inspect.isclass(cls) and issubclass(cls, LRScheduler) and cls is not LRScheduler and not name.startswith("_"):
        return cls
    raise ScheduleConfigError(f"scheduler.type: got {name!r}; allowed: {', '.join(DEEPSPEED_SCHEDULES)} (DeepSpeed's) "
                              "or the name of a class in torch.optim.lr_scheduler")


def check_params(name: str, params: dict) -> None:
    """Every key of ``params`` is a parameter of the class and every required one is given."""
    cls = schedule_class(name)
    sig = inspect.signature(cls.__init__)
    accepted = [p for p in list(sig.parameters.values())[2:]  # self, optimizer
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    names = [p.name for p in accepted]
    for key in params:
        if key not in names:
            raise ScheduleConfigError(f"scheduler.params.{key}: not a parameter of {name}; allowed: {', '.join(names)}")
    kind = params.get("warmup_type")
    if "warmup_type" in names and kind is not None and kind not in WARMUP_TYPES:
        # the classes fall back to 'log' with a warning, as DeepSpeed's; a config's typo is named instead
        raise ScheduleConfigError(f"scheduler.params.warmup_type: got {kind!r}; allowed: "
                                  f"{', '.join(map(repr, WARMUP_TYPES))}")
    missing = [p.name for p in accepted if p.default is inspect.Parameter.empty and p.name not in params]
    if missing:
        raise ScheduleConfigError(f"scheduler.params.{missing[0]}: required by {name} and missing"
                                  + (f" (also missing: {', '.join(missing[1:])})" if len(missing) > 1 else ""))


def from_config(name: str | None, params: dict, optimizer) -> LRScheduler | None:
    if name is None:
        return None
    check_params(name, params)
    cls = schedule_class(name)
    try:
        return cls(optimizer, **params)
    except (TypeError, ValueError) as e:
        raise ScheduleConfigError(f"scheduler ({name}): {e}") from e


def client_schedule(lr_scheduler, optimizer, client_optimizer=None) -> LRScheduler | None:
    """``lr_scheduler`` as passed to initialize: an LRScheduler object over ``optimizer`` (the
    engine's face) or over ``client_optimizer`` (whose param_groups the face shares, so the
    schedule's writes reach the engine), a callable ``optimizer -> scheduler``, or None. One over
    another optimizer is accepted with a warning, as DeepSpeed accepts it: stepped, reaching nothing."""
    if lr_scheduler is None:
        return None
    # a scheduler class is such a callable too (DeepSpeed calls whatever is Callable; an LRScheduler object is not)
    if isinstance(lr_scheduler, type) or (not isinstance(lr_scheduler, LRScheduler) and callable(lr_scheduler)
                                          and not hasattr(lr_scheduler, "step")):
        lr_scheduler = lr_scheduler(optimizer)
    if not hasattr(lr_scheduler, "step") or not hasattr(lr_scheduler, "state_dict"):
        raise TypeError(f"zerocore.initialize: lr_scheduler must be a torch.optim.lr_scheduler.LRScheduler or a "
                        f"callable taking the optimizer and returning one; got {type(lr_scheduler).__name__}")
    target = getattr(lr_scheduler, "optimizer", optimizer)
    if target is not optimizer and (client_optimizer is None or target is not client_optimizer):
        # DeepSpeed takes it as it is (and steps it); so does zerocore, but says that it changes nothing here
        warnings.warn("zerocore.initialize: lr_scheduler schedules another optimizer than the engine's: the engine "
                      "steps it, but its learning rates are not the engine's (they stay as they are). Build it over "
                      "the optimizer passed to initialize (its param_groups become the engine's), or pass a callable "
                      "`lambda optimizer: Scheduler(optimizer, ...)`", UserWarning, stacklevel=4)
    return lr_scheduler
