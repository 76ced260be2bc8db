"""Transformers' own ZeRO-3 rules, applied to zerocore's stage 3 while its code runs the model.

Transformers asks ``is_deepspeed_zero3_enabled()`` (which reads the weak reference
``transformers.integrations.deepspeed._hf_deepspeed_config_weak_ref`` that DeepSpeed's config sets)
where parameters are sharded across ranks: ``generate`` then defaults to ``synced_gpus=True`` (a rank
whose sequences ended keeps joining the others' forward passes, whose stage-3 gathers are
collectives: without it the ranks hang), and so does ``Seq2SeqTrainer(predict_with_generate=True)``.
With zerocore none of that fired: plain ``model.generate`` hung at stage 3 over several ranks when
the ranks' sequences ended at different lengths.

``zero3_visible(get_engine)`` makes that question answer True *only while the block runs* and only
while ``get_engine()`` returns a live stage-3 engine, then puts back whatever was registered before.
It is not set for the engine's whole life on purpose: Transformers also keys model construction on
it (``from_pretrained`` / ``from_config`` would build any other model under ``deepspeed.zero.Init``,
resizing embeddings would use ``deepspeed.zero.GatheredParameters``), which must not happen to a
reference or reward model built while a zerocore engine trains. It is visible:

- inside ``generate`` of every Transformers model a stage-3 engine holds (``adopt``: the model's
  class is swapped for a subclass whose ``generate`` runs in the block, for as long as the engine
  holds it: ``destroy()`` gives the class back), so plain ``model.generate(...)`` (and PEFT's, which
  calls the wrapped model's) picks ``synced_gpus`` as under DeepSpeed; a ``synced_gpus`` passed in
  still wins;
- inside ``ZeroTrainer``'s evaluation and prediction loops (``trainer.py``), so
  ``Seq2SeqTrainer(predict_with_generate=True)`` passes ``synced_gpus=True`` itself;
- inside the Trainer's parameter count as training starts (``zero3_param_counts``), so its log counts the
  partitioned parameters whole.

With ``zero_optimization.stage3_gather_for_generation`` (TRL's trainers set it from their
``ds3_gather_for_generation``) the swapped ``generate`` also gathers the whole model once for the call, as TRL
gathers DeepSpeed's ZeRO-3 model for generation, instead of each unit at every new token.

The same swapped class's ``save_pretrained`` refuses, with a message saying how to save the full
weights, to write a model whose partitioned parameters are empty tensors there (given a ``state_dict``
it saves that).
"""
from __future__ import annotations

import contextlib
import os
import weakref

from ...runtime.ds_param_attrs import is_partitioned_now
from ...runtime.gathered import gathered, owner_of


class Zero3View:
    """What Transformers reads of a DeepSpeed config through its weak reference: ``is_zero3()`` and
    ``config``. Answers for the engine ``get_engine()`` returns at the time of asking (None: no)."""

    def __init__(self, get_engine):
        self._get_engine = get_engine

    def _engine(self):
        engine = self._get_engine()
        if engine is None or getattr(engine, "module", None) is None:  # none yet, or destroyed
            return None
        return engine if engine.config.zero_optimization.stage == 3 else None

    def is_zero3(self) -> bool:
        return self._engine() is not None

    @property
    def config(self) -> dict:
        e = self._engine()
        return {"zero_optimization": {"stage": 3}} if e is not None else {}


@contextlib.contextmanager
def zero3_visible(get_engine):
    """Transformers' ``is_deepspeed_zero3_enabled()`` is true inside the block while ``get_engine()``
    is a live stage-3 engine (see the module docstring); the previous registration comes back after."""
    from transformers.integrations import deepspeed as hf_ds

    view = Zero3View(get_engine)  # alive for the block: the weak reference Transformers keeps is to it
    before = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds._hf_deepspeed_config_weak_ref = weakref.ref(view)
    try:
        yield view
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = before


@contextlib.contextmanager
def zero3_param_counts(get_engine):
    """Inside the block the Trainer's ``get_model_param_count`` (its "Number of trainable parameters" log at the
    start of training) counts under ``zero3_visible(get_engine)``: Transformers' own ZeRO-3 rule then counts each
    parameter's ``ds_numel``, where a partitioned parameter's ``numel()`` is its empty stand-in's 0. The name is
    Transformers' module global in ``transformers.trainer`` (the loop's call site), put back after the block."""
    import transformers.trainer as hf_trainer

    original = getattr(hf_trainer, "get_model_param_count", None)
    if original is None:  # a Transformers without that call: nothing to count
        yield
        return

    def get_model_param_count(model, trainable_only=False):
        with zero3_visible(get_engine):
            return original(model, trainable_only)

    hf_trainer.get_model_param_count = get_model_param_count
    try:
        yield
    finally:
        hf_trainer.get_model_param_count = original


def _engine_of(module):
    return next((owner_of(p) for p in module.parameters()), None)


def _whole_for_generation(model):
    """``zero_optimization.stage3_gather_for_generation``: the whole model gathered once for a ``generate`` call
    (``zerocore.gathered`` keeps the units whole through its forwards), else each unit per forward."""
    engine = _engine_of(model)
    if engine is None or not engine.config.zero_optimization.stage3_gather_for_generation:
        return contextlib.nullcontext()
    return gathered(list(model.parameters()))


_STAGE3: dict[type, type] = {}


def stage3_class(cls: type) -> type:
    """``cls`` (a Transformers model class) as a stage-3 engine holds it: ``generate`` (of a generation model) runs
    under ``zero3_visible`` for the engine holding the model; ``save_pretrained`` without a ``state_dict`` refuses
    to write partitioned parameters, which are empty tensors outside a forward (the files would hold 0-element
    weights, found only when loaded: DeepSpeed's ZeRO-3 writes them so)."""
    if getattr(cls, "_zc_stage3_class", False):
        return cls
    if cls in _STAGE3:
        return _STAGE3[cls]
    from transformers.generation import GenerationMixin

    def generate(self, *args, **kwargs):
        with zero3_visible(lambda: _engine_of(self)), _whole_for_generation(self):
            return super(new, self).generate(*args, **kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        if kwargs.get("state_dict") is None:
            empty = [n for n, p in self.named_parameters() if is_partitioned_now(p)]
            if empty:
                raise ValueError(
                    f"zerocore: {type(self).__name__}.save_pretrained({os.fspath(save_directory)!r}) at ZeRO stage 3 "
                    f"would write {len(empty)} partitioned parameters as empty tensors ('{empty[0]}' first): each "
                    "rank holds a chunk of them. Save the full weights: on every rank (a collective) "
                    "`state = engine.full_state_dict()`, then `model.save_pretrained(dir, state_dict=state)` "
                    "(Trainer: trainer.save_model(dir), on every rank)")
        return super(new, self).save_pretrained(save_directory, *args, **kwargs)

    attrs = {"save_pretrained": save_pretrained, "_zc_stage3_class": True, "__module__": cls.__module__,
             "__qualname__": cls.__qualname__}
    if issubclass(cls, GenerationMixin):
        attrs["generate"] = generate
    new = type(cls.__name__, (cls,), attrs)
    _STAGE3[cls] = new
    return new


def adopt(engine) -> None:
    """A stage-3 engine was built: each Transformers model in its module gets the class of ``stage3_class`` while
    the engine holds it (the gatherer gives the class back)."""
    from transformers import PreTrainedModel

    for m in engine.module.modules():
        if isinstance(m, PreTrainedModel) and not getattr(type(m), "_zc_stage3_class", False):
            engine.gatherer.swap_class(m, stage3_class(type(m)))
