"""The models a trainer runs but does not train (TRL's reference model, its reward models, a distillation teacher),
partitioned at stage 3 as TRL's DeepSpeed path partitions them.

TRL wraps each one with ``prepare_deepspeed``: its config without the ``optimizer`` / ``scheduler`` sections
and without ``offload_optimizer``, given to ``deepspeed.initialize`` with no optimizer, which at stage 3 is an
inference engine (the parameters partitioned, gathered module by module in the forward); below stage 3 it
keeps the model whole on every rank (stage 0). Without DeepSpeed, TRL leaves such a model whole, so on
zerocore a reference model cost every rank its whole 16-bit weights at stage 3. Here the trainer's
``__init__`` (``ZeroTrainerMixin``) replaces each with a zerocore engine that trains nothing
(``zerocore.initialize(frozen=True)``, ``runtime/trains_nothing.py``) behind the same thin module the policy
runs through (``EngineModule``: calls go through the engine, attributes such as ``config`` are the model's).
"""
from __future__ import annotations

import torch

from .._common import evaluation_config
from .._wrapping import EngineModule
from .config import fill_auto, zero_stage

# the attributes TRL's trainers hold such models in (DPO, KTO, GRPO, RLOO, Online DPO: ref_model; GKD and
# distillation: teacher_model), and GRPO / RLOO's reward_funcs, whose modules are reward models: each called (its
# forward). TRL's distillation loss also projects with the teacher's lm_head weight, read after the teacher's forward
# has returned, where a partitioned weight is the empty tensor (its loss was 0.0 at stage 3; DeepSpeed's ZeRO-3
# teacher is empty there too): a teacher's output embeddings stay whole (stage3_persistent_param_names), the rest
# of it partitioned
FROZEN_ATTRS = ("ref_model", "teacher_model")
WHOLE_HEAD_ATTRS = ("teacher_model",)
REWARD_LIST = "reward_funcs"


def frozen_config(config: dict, args, model) -> dict:
    """The trainer's zerocore config for a model it does not train, as TRL's ``prepare_deepspeed`` makes it:
    ``"auto"`` filled from the arguments, the optimizer, its schedule and its offload removed."""
    return evaluation_config(fill_auto(config, args, model))


def output_embedding_names(model: torch.nn.Module) -> list[str]:
    """The names of ``model``'s output-embedding parameters (``get_output_embeddings()``: the lm_head, with every
    name a tied weight has); none for a model without them."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, torch.nn.Module):
        return []
    ids = {id(p) for p in head.parameters()}
    return sorted(n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in ids)


def shard_frozen_models(trainer) -> list:
    """At stage 3: each model of ``FROZEN_ATTRS`` and each module of ``reward_funcs`` on ``trainer`` becomes an
    ``EngineModule`` over a zerocore engine that trains nothing; returns those engines (none below stage 3,
    where the models stay whole as with TRL on DeepSpeed). Refuses TRL's ``sync_ref_model`` at stage 3 (below)."""
    if zero_stage(trainer.zerocore_config) != 3:
        return []
    import zerocore

    engines = []

    def wrap(model, whole_head: bool = False):
        if not isinstance(model, torch.nn.Module) or isinstance(model, EngineModule):
            return model
        config = frozen_config(trainer.zerocore_config, trainer.args, model)
        names = output_embedding_names(model) if whole_head else []
        if names:
            z = config.setdefault("zero_optimization", {})
            z["stage3_persistent_param_names"] = sorted(set(z.get("stage3_persistent_param_names", [])) | set(names))
        engine = zerocore.initialize(model, config, frozen=True)
        engine.eval()
        engines.append(engine)
        return EngineModule(engine)

    for attr in FROZEN_ATTRS:
        model = getattr(trainer, attr, None)
        if isinstance(model, torch.nn.Module):
            if attr == "ref_model" and getattr(trainer.args, "sync_ref_model", False):
                raise ValueError("zerocore: sync_ref_model=True with zero_optimization.stage 3: TRL's callback mixes "
                                 "the policy into the reference model parameter by parameter, and at stage 3 both "
                                 "are partitioned (each parameter an empty tensor outside its module's forward), so "
                                 "it would change nothing; use stage 2, or sync_ref_model=False")
            setattr(trainer, attr, wrap(model, whole_head=attr in WHOLE_HEAD_ATTRS))
    rewards = getattr(trainer, REWARD_LIST, None)
    if isinstance(rewards, list):
        for i, fn in enumerate(rewards):
            rewards[i] = wrap(fn)
    return engines
