"""An engine that trains nothing: a reference, teacher or evaluation model run through ZeRO.

DeepSpeed builds one when ``deepspeed.initialize`` gets no optimizer (and the config has no
``optimizer`` section): at stage 3 its parameters are partitioned and gathered module by module in
the forward (``DeepSpeedZeRoOffload``), with no gradient buffer and no optimizer state. TRL wraps
its DPO / GRPO reference models this way and Transformers' ``Trainer`` its evaluation-only model.
Here every parameter of such an engine is frozen: at stage 3 each unit's parameters are one
partitioned frozen group (``frozen_groups.py``: the owned chunk in the training dtype is all a rank
keeps), below stage 3 they stay whole; the optimizer face has one group, of no parameter.

What it cannot do is refused with an error naming why (``refuse``): ``backward``, ``step``, a
backward that reaches its outputs, and, when asked at initialize, an optimizer, parameter groups or
a schedule (an engine that trains nothing would silently drop them).
"""
from __future__ import annotations

import weakref

import torch

from .client_optimizer import from_config
from .model_setup import all_named_params
from .param_groups import ResolvedGroups


class NothingToTrain(RuntimeError, AssertionError):
    """Training asked of an engine that trains nothing (DeepSpeed asserts: an AssertionError too)."""


def trains(wanted: bool, trainable: list, frozen: list, optimizer, model_parameters, lr_scheduler) -> bool:
    """Whether the engine trains: ``wanted`` (False: ``zerocore.initialize(frozen=True)``, or DeepSpeed's face
    given no optimizer). A model with no parameter at all is refused, and one with none that requires grad
    unless ``frozen=True`` says so (a model frozen by mistake is named at initialize, not at its first backward)."""
    if not trainable and not frozen:
        raise ValueError("zerocore: the model has no parameters")
    if wanted and not trainable:
        raise ValueError("zerocore: the model has no trainable parameters (none requires grad); to run a model "
                         "without training it (a reference, teacher or evaluation model) pass frozen=True")
    if not wanted:
        given = [name for name, value in (("optimizer", optimizer), ("model_parameters", model_parameters),
                                          ("lr_scheduler", lr_scheduler)) if value is not None]
        if given:
            raise ValueError(f"zerocore.initialize: frozen=True trains nothing; {', '.join(given)} would be "
                             "ignored: pass none of them, or frozen=False to train")
    return wanted


def everything_frozen(module: torch.nn.Module, config):
    """(trainable, frozen, client optimizer, groups) of an engine that trains nothing: no trainable
    parameter, every parameter frozen in the model's registration order (``model_setup.all_named_params``),
    the config's Adam defaults on a face whose one group holds no parameter."""
    frozen = all_named_params(module)
    client = from_config(config)
    # one empty group: a torch optimizer needs one, and the face's lr / get_lr keep their meaning
    return [], frozen, client, ResolvedGroups([{"params": [], **client.defaults}], {}, [])


def refuse(engine, what: str) -> None:
    """Raises ``NothingToTrain`` for ``what`` (``backward``, ``step()``...) on ``engine``, which trains nothing."""
    raise NothingToTrain(
        f"zerocore: {what} on an engine that trains nothing (built with no optimizer: zerocore.initialize(frozen=True), "
        "or zerocore.deepspeed.initialize / ZeroAccelerator.prepare given no optimizer and a config with no "
        "'optimizer' section, which is DeepSpeed's inference engine: 'must provide optimizer during init'); run its "
        "forward under torch.no_grad(), or give it an optimizer to train it")


def output_hook(engine):
    """The hook an engine that trains nothing puts on its forwards' outputs, or None (no hook). At stage 3
    with a parameter that requires grad (``frozen=True`` on a trainable model) a backward reaching the
    outputs is refused: autograd would give that parameter a whole gradient while its unit is gathered, and
    the partitioned parameter has no place for it. Otherwise a backward is torch's own (gradients reach the
    inputs; below stage 3 a parameter that requires grad gets its ``.grad`` as in a plain module; at stage 3
    the units are gathered again for it). Weak, as ``torch_backward.output_hook``: a graph the user keeps
    does not keep the engine."""
    if engine.gatherer is None or not any(p.requires_grad for p in engine.module.parameters()):
        return None
    me = weakref.ref(engine)

    def on_output_reached() -> None:
        eng = me()
        if eng is not None:
            refuse(eng, "a backward through the forward's outputs (its parameters require grad)")
    return on_output_reached
