"""Hugging Face ``Trainer`` (and its subclasses: TRL's ``SFTTrainer``, ...) driving a zerocore engine.

``ZeroTrainerMixin`` goes first among the bases (``make_zero_trainer(SFTTrainer)`` builds that
class) and overrides the Trainer's overridable methods, nothing in the library itself:

- ``create_optimizer``: the Trainer's own optimizer (or the config's ``optimizer`` section) gives
  the engine its hyperparameters and parameter groups; the engine is built here, and the Trainer
  keeps an optimizer face whose ``param_groups`` its scheduler writes and the engine reads;
- ``_wrap_model``: the model is driven through the engine instead of DDP (a thin module whose
  forward is the engine's, so Accelerate does not wrap it again);
- ``training_step``: the Trainer's own step (loss, accumulation scaling, logging), with its
  ``backward`` going to the engine, which updates where the Trainer steps (its ``sync_gradients``,
  an epoch's short last window included, as Accelerate does for DeepSpeed);
  ``_clip_grad_norm`` / ``_get_grad_norm`` report the engine's (it clips);
- ``evaluation_loop``: at stage 3 Transformers' ZeRO-3 rules hold inside it (``zero3.py``:
  ``Seq2SeqTrainer``'s generation syncs the ranks); an evaluation or prediction before training runs
  on an engine that trains nothing (no gradient buffer, no optimizer state: an evaluation-only script
  holds the model's shards only), as Transformers builds DeepSpeed's inference engine there; when
  training starts that engine gives the model to the training engine still partitioned
  (``destroy(partitioned=True)``), in the training dtype: the fp32 master then starts from the
  16-bit values, as DeepSpeed's does after its inference engine;
- checkpoints: ``_save_optimizer_and_scheduler`` / ``_load_optimizer_and_scheduler`` write and
  read a zerocore checkpoint (loadable at any world size) plus the scheduler's state;
- ``save_model``: full weights gathered from the shards, written by ``save_pretrained`` as
  safetensors (PEFT models: the adapters only);
- at stage 3 a reference or reward model the trainer holds (TRL's) runs on an engine that trains
  nothing, its parameters partitioned, as TRL's DeepSpeed path does (``frozen_models.py``).
"""
from __future__ import annotations

import os
import warnings
import weakref

import torch
from .._common import (EngineOptimizer, backward_at, compile_as_accelerate, global_grad_norm, initialize,
                       optimizer_section, sync_lr)
from .._wrapping import EngineModule, read_config
from .config import fill_auto
from .frozen_models import frozen_config, shard_frozen_models
from .zero3 import zero3_param_counts, zero3_visible

SCHEDULER_NAME = "scheduler.pt"


class _EngineScheduler:
    """The Trainer's view of a schedule the engine steps itself (the config's ``scheduler``)."""

    def __init__(self, engine):
        self.engine = engine

    def step(self, *args, **kwargs) -> None:
        pass

    def get_last_lr(self):
        return self.engine.get_lr()

    def state_dict(self):
        return {}

    def load_state_dict(self, state) -> None:
        pass


class ZeroTrainerMixin:
    """Put first among a Trainer class's bases; give ``zerocore_config`` (dict or JSON path).

    Leave ``TrainingArguments.deepspeed`` unset: the config goes here, its ``"auto"`` values are
    filled from the arguments as Transformers fills DeepSpeed's."""

    def __init__(self, *args, zerocore_config=None, **kwargs):
        if zerocore_config is None:
            raise TypeError(f"{type(self).__name__} needs zerocore_config= (a zerocore/DeepSpeed config dict or "
                            "JSON path)")
        self.zerocore_config = read_config(zerocore_config)
        self.zerocore_engine = None
        self._zc_wrapper = None
        self._zc_eval = None  # (engine, wrapper) of an evaluation before training: trains nothing
        super().__init__(*args, **kwargs)
        if getattr(self.args, "deepspeed", None):
            raise ValueError("TrainingArguments(deepspeed=...) is set: with zerocore pass the config as "
                             "zerocore_config= and leave deepspeed unset (it would import DeepSpeed)")
        # fail on contradictions now rather than when training starts
        fill_auto(self.zerocore_config, self.args, self.model)
        unwrap_engine_modules(self.accelerator)
        # a reference / reward model the trainer holds: partitioned at stage 3 (frozen_models.py)
        self.zerocore_frozen_engines = shard_frozen_models(self)

    # -- the engine ----------------------------------------------------------------------
    def create_optimizer(self, model=None):
        if self.zerocore_engine is None:
            self._zc_build()
        return self.optimizer

    def _zc_build(self) -> None:
        self._zc_end_evaluation_engine()
        steps = getattr(getattr(self, "state", None), "max_steps", None) or None
        cfg = fill_auto(self.zerocore_config, self.args, self.model, steps)
        if "optimizer" in cfg:  # DeepSpeed's way: every trainable parameter in one group
            p = cfg["optimizer"].get("params", {})
            trainable = [q for q in self.model.parameters() if q.requires_grad]
            groups = [{"params": trainable, "lr": p.get("lr", 1e-3), "betas": tuple(p.get("betas", (0.9, 0.999))),
                       "eps": p.get("eps", 1e-8), "weight_decay": p.get("weight_decay", 0.0)}]
        else:  # the Trainer's optimizer (its decay / no-decay groups) read as a client optimizer
            if self.optimizer is None:
                super().create_optimizer()
            cfg["optimizer"], groups = optimizer_section(self.optimizer)
        engine = initialize(self.model, cfg, groups)
        compile_as_accelerate(engine, self.accelerator)  # torch_compile=True: as the Trainer on DeepSpeed
        self.zerocore_engine = engine
        self._zc_wrapper = EngineModule(engine)
        self._zc_owns_schedule = "scheduler" in cfg
        if self._zc_owns_schedule:
            if getattr(engine, "lr_scheduler", None) is None:
                raise ValueError("zerocore config: the 'scheduler' section needs a zerocore engine with LR schedules; "
                                 "remove it to use the Trainer's lr_scheduler_type / warmup arguments")
            self.lr_scheduler = _EngineScheduler(engine)
        face = getattr(engine, "optimizer", None)
        self.optimizer = face if hasattr(face, "param_groups") else EngineOptimizer(groups)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.zerocore_engine is not None and self._zc_owns_schedule:
            return self.lr_scheduler
        return super().create_scheduler(num_training_steps, optimizer)

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if self.zerocore_engine is None:
            if not training:  # evaluation or prediction before training
                return self._zc_evaluation_engine()[1]
            self._zc_build()
        return self._zc_wrapper

    def _zc_evaluation_engine(self):
        """(engine, wrapper) for an evaluation before training: the config as for TRL's reference model (no
        optimizer, schedule or optimizer offload), an engine that trains nothing (``runtime/trains_nothing.py``)."""
        if self._zc_eval is None:
            engine = initialize(self.model, frozen_config(self.zerocore_config, self.args, self.model), frozen=True)
            compile_as_accelerate(engine, self.accelerator)
            self._zc_eval = (engine, EngineModule(engine))
        return self._zc_eval

    def _zc_end_evaluation_engine(self) -> None:
        """Training starts after an evaluation: the evaluation engine gives the model back, stage 3's parameters
        still partitioned (each rank its chunk, as ``zerocore.init`` leaves them; the whole model is never on one
        rank), and the training engine adopts them."""
        if self._zc_eval is not None:
            engine, _ = self._zc_eval
            self._zc_eval = None
            engine.destroy(partitioned=True)

    @property
    def zerocore_eval_engine(self):
        """The engine that trains nothing an evaluation or prediction before training ran on (None otherwise,
        and once training started: the training engine, ``zerocore_engine``, holds the model then)."""
        return self._zc_eval[0] if self._zc_eval is not None else None

    def _zc_running_engine(self):
        """The engine the model runs on now: the training one, or the evaluation one before training."""
        return self.zerocore_engine if self.zerocore_engine is not None else self.zerocore_eval_engine

    def _inner_training_loop(self, *args, **kwargs):
        # the loop's "Number of trainable parameters" log counts stage-3 parameters whole (zero3.py), as on DeepSpeed
        with zero3_param_counts(self._zc_running_engine):
            return super()._inner_training_loop(*args, **kwargs)

    # -- one micro-batch -----------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        acc = self.accelerator
        acc.backward = self._zc_backward  # this Accelerator instance only, for this call
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            del acc.backward

    def _zc_backward(self, loss, **kwargs) -> None:
        engine = self.zerocore_engine
        # the Trainer's own boundary: it sets sync_gradients before each micro-batch, True at the end
        # of each window and at an epoch's last micro-batch (a short window); its loss is already
        # divided for accumulation (by num_items_in_batch, or by the window's own length)
        boundary = self.accelerator.sync_gradients
        backward_at(engine, loss, boundary, divided=True)
        if boundary and not self._zc_owns_schedule:
            sync_lr(engine, self.optimizer)
        engine.step()  # updates at the boundary only

    def _clip_grad_norm(self, model):
        return global_grad_norm(self.zerocore_engine)  # the engine clipped (gradient_clipping = max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        return grad_norm if grad_norm is not None else global_grad_norm(self.zerocore_engine)

    def floating_point_ops(self, inputs) -> int:
        """Transformers' estimate (6 x the main input's tokens x the non-embedding parameters: the ``total_flos``
        the Trainer reports), with each parameter's whole size: at stage 3 ``model.num_parameters()`` counts the
        empty stand-ins a partitioned model holds outside a forward (DeepSpeed's ZeRO-3 reports that too)."""
        engine = self._zc_running_engine()
        model = self.model
        main = getattr(model, "main_input_name", "input_ids")
        if engine is None or engine.config.zero_optimization.stage != 3 or main not in inputs \
                or not hasattr(model, "num_parameters"):
            return super().floating_point_ops(inputs)
        embeddings = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
        params = sum(getattr(p, "ds_numel", p.numel()) for n, p in model.named_parameters() if n not in embeddings)
        return 6 * inputs[main].numel() * params

    # -- evaluation ----------------------------------------------------------------------
    def evaluation_loop(self, *args, **kwargs):
        """The Trainer's loop, with Transformers' ZeRO-3 rules on while a stage-3 engine runs it
        (``zero3.py``): ``Seq2SeqTrainer(predict_with_generate=True)`` then generates with
        ``synced_gpus``, so ranks whose sequences end at different lengths do not hang. The engine
        may be built inside the loop (evaluation before training): asked for when Transformers asks."""
        with zero3_visible(self._zc_running_engine):
            return super().evaluation_loop(*args, **kwargs)

    # -- checkpoints ---------------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.zerocore_engine.save_checkpoint(output_dir)
        if self.args.should_save and not self._zc_owns_schedule:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if checkpoint is None:
            return
        path, _ = self.zerocore_engine.load_checkpoint(checkpoint)
        if path is None:
            raise FileNotFoundError(f"zerocore: {checkpoint} holds no zerocore checkpoint (no 'latest' file); "
                                    "resume from a checkpoint written by a zerocore Trainer")
        sched = os.path.join(checkpoint, SCHEDULER_NAME)
        if not self._zc_owns_schedule and os.path.isfile(sched):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))
            # the optimizer state is the engine's: the groups' current lr comes from the schedule
            for g, lr in zip(self.optimizer.param_groups, self.lr_scheduler.get_last_lr()):
                g["lr"] = lr

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if self.zerocore_engine is None:
            return  # the engine's checkpoint brings the weights once the engine exists
        from .loading import load_pretrained_weights

        load_pretrained_weights(self.model, resume_from_checkpoint)

    def _load_best_model(self) -> None:
        # load_best_model_at_end: the weights of the best checkpoint's zerocore checkpoint, into the
        # engine's shards and master copy (a load_state_dict on the module would miss the master)
        best = self.state.best_model_checkpoint
        path, _ = self.zerocore_engine.load_checkpoint(best, load_module_only=True)
        if path is None:
            raise FileNotFoundError(f"zerocore: the best checkpoint {best} holds no zerocore checkpoint")

    # -- weights out ---------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        engine = self._zc_running_engine()  # (an evaluation engine's stage-3 parameters are chunks too)
        if engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state = engine.full_state_dict()  # a collective: every rank gathers
        if engine.dtype != torch.float32:
            state = {k: v.to(engine.dtype) if v.is_floating_point() else v for k, v in state.items()}
        self._save(output_dir, state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)


def unwrap_engine_modules(accelerator) -> None:
    """The Trainer's ``accelerator.unwrap_model`` gives the model inside an ``EngineModule`` (the wrapper the
    trainer calls in place of DDP), as Accelerate gives the model inside DDP or DeepSpeed's engine. Trainers
    rely on it: TRL's forward redirection patches the unwrapped model's ``forward`` and calls the wrapper, so
    the loss runs inside the engine's forward (at stage 3 a parameter read there, such as the ``lm_head``
    weight TRL's distillation loss projects with, is gathered; outside it is the empty partition), and the
    Trainer's label smoothing reads the unwrapped model's class name. Only this instance is changed, holding
    it weakly (no cycle through the accelerator)."""
    unwrap = type(accelerator).unwrap_model
    me = weakref.ref(accelerator)

    def unwrap_model(model, *args, **kwargs):
        if isinstance(model, EngineModule):
            return model.module
        return unwrap(me(), model, *args, **kwargs)

    accelerator.unwrap_model = unwrap_model


def make_zero_trainer(trainer_cls: type) -> type:
    """``trainer_cls`` (``Trainer`` or a subclass) driving zerocore: ``ZeroTrainerMixin`` first."""
    if issubclass(trainer_cls, ZeroTrainerMixin):
        return trainer_cls
    return type(f"Zero{trainer_cls.__name__}", (ZeroTrainerMixin, trainer_cls), {"__module__": __name__})
