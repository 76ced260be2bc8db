"""A Lightning ``Strategy`` that trains with zerocore: ``Trainer(strategy="zerocore_stage_2")``.

Importing this module registers, in Lightning's ``StrategyRegistry``, ``"zerocore"`` (config
decides), ``"zerocore_stage_1"``, ``"zerocore_stage_2"``, ``"zerocore_stage_2_offload"``,
``"zerocore_stage_3"`` and ``"zerocore_stage_3_offload"``. Processes start and meet as with DDP
(Lightning's launcher or torchrun); then the engine replaces DDP:

- ``configure_model`` runs under ``zerocore.init`` at stage 3 (parameters partitioned as built);
- the optimizer from ``configure_optimizers`` (Adam/AdamW) gives the engine its hyperparameters
  and stays the object the schedulers write ``lr`` into; the engine reads it at each update;
- ``accumulate_grad_batches`` becomes the engine's accumulation, ``gradient_clip_val`` its
  ``gradient_clipping`` (by norm; by value is refused);
- checkpoints are zerocore checkpoints (a directory, loadable at another world size), with
  Lightning's own state (loops, callbacks, schedulers) stored as their client state;
- the optimizer steps where Lightning steps (an epoch's short last window included, as DDP);
- ``validate``/``test``/``predict`` run on an engine that trains nothing (no gradient buffer, fp32 master or
  optimizer state), as Lightning's DeepSpeed strategy builds DeepSpeed's inference engine there; with a
  ``ckpt_path`` it reads the checkpoint's trained weights (their fp32 masters);
- at the end of each ``fit``/``validate``/``test``/``predict`` (``teardown``) the engine is destroyed:
  its memory is freed then, not when Python's cyclic collector reaches Lightning's Trainer, and the
  model holds the trained weights (full, at every stage).
"""
from __future__ import annotations

import copy
import json
from contextlib import contextmanager, nullcontext
from typing import Any

from ._common import (EngineOptimizer, backward_at, check_version, evaluation_config, initialize, optimizer_section,
                      sync_lr)

LIGHTNING_VERSION = check_version("lightning", "2.4", "3", "zerocore.integrations.lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.plugins.precision import Precision  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry  # noqa: E402
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus  # noqa: E402
from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402

import zerocore  # noqa: E402

_GROUP_LRS = "zerocore_param_group_lrs"  # client-state key: the schedulers' current lr per group
_PRECISIONS = {"32-true": {}, "32": {}, "bf16-mixed": {"bf16": {"enabled": True}},
               "bf16-true": {"bf16": {"enabled": True}}, "16-mixed": {"fp16": {"enabled": True}},
               "16-true": {"fp16": {"enabled": True}}}


class ZerocorePrecision(Precision):
    """Backward and step through the engine; the engine clips (``gradient_clipping``).

    The accumulation window ends where Lightning steps: Lightning calls ``optimizer_step`` (whose
    closure runs the micro-batch's backward) at the end of each window and at an epoch's last batch,
    a short window when the epoch's batches are not a multiple of ``accumulate_grad_batches``, as
    with DDP; every other micro-batch's backward comes outside it."""

    def __init__(self, precision: str = "32-true") -> None:
        if str(precision) not in _PRECISIONS:
            raise ValueError(f"zerocore strategy: precision={precision!r} is not supported; use one of "
                             f"{sorted(_PRECISIONS)}")
        self.precision = str(precision)
        self.engine = None  # set by the strategy once built
        self._in_optimizer_step = False

    def backward(self, tensor, model, optimizer, *args, **kwargs) -> None:
        engine = self.engine
        # manual optimization (no accumulation in Lightning there): each backward ends its window,
        # the user's optimizer.step() comes next
        boundary = self._in_optimizer_step or not model.automatic_optimization
        # Lightning already divided the loss by accumulate_grad_batches, a short window too
        backward_at(engine, tensor, boundary, divided=True)
        if not boundary:
            engine.step()  # inside the window: counts the micro-batch, updates nothing

    def optimizer_step(self, optimizer, model, closure, **kwargs) -> Any:
        self._in_optimizer_step = True
        try:
            result = closure()  # training_step + backward of the window's last micro-batch
        finally:
            self._in_optimizer_step = False
        self._after_closure(model, optimizer)
        if model.automatic_optimization and result is None:
            raise RuntimeError("zerocore strategy: training_step returned None (a skipped backward); the engine "
                               "needs every micro-batch's backward")
        sync_lr(self.engine, optimizer)
        self.engine.step()
        return result

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM) -> None:
        pass  # done by the engine inside step(), over every rank's gradients


def _summaries_count_whole(trainer: "pl.Trainer") -> None:
    """Lightning's model summary (printed as ``fit`` starts, after the strategy's setup) counts ``p.numel()``: 0 for
    a stage-3 parameter resting partitioned. Under its DeepSpeed strategy at stage 3 it takes ``DeepSpeedSummary``
    instead (each parameter's ``ds_numel``, and a column of this rank's part per layer); so does each
    ``ModelSummary`` callback of a trainer whose strategy is zerocore's at stage 3."""
    from lightning.pytorch.callbacks import ModelSummary
    from lightning.pytorch.utilities.model_summary import DeepSpeedSummary

    for cb in trainer.callbacks:
        if not isinstance(cb, ModelSummary) or "_summary" in cb.__dict__:
            continue
        plain = cb._summary

        def summary(trainer, pl_module, cb=cb, plain=plain):
            strategy = trainer.strategy
            if isinstance(strategy, ZerocoreStrategy) and strategy.zero_stage == 3:
                return DeepSpeedSummary(pl_module, max_depth=cb._max_depth)
            return plain(trainer, pl_module)

        cb._summary = summary


class ZerocoreStrategy(DDPStrategy):
    """DDP's process management with a zerocore engine in place of DDP.

    ``config``: a zerocore/DeepSpeed config (dict or JSON path); ``stage``, ``offload_optimizer``
    and ``offload_parameters`` fill ``zero_optimization`` when the config leaves them out."""

    strategy_name = "zerocore"

    def __init__(self, config: dict | str | None = None, stage: int | None = None, offload_optimizer: bool = False,
                 offload_parameters: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("process_group_backend", None)
        super().__init__(**kwargs)
        if isinstance(config, str):
            with open(config) as f:
                config = json.load(f)
        self.config = copy.deepcopy(config) if config is not None else {}
        z = self.config.setdefault("zero_optimization", {})
        if stage is not None:
            z.setdefault("stage", stage)
        if offload_optimizer:
            z.setdefault("offload_optimizer", {"device": "cpu"})
        if offload_parameters:
            z.setdefault("offload_param", {"device": "cpu"})
        self.engine = None

    @property
    def zero_stage(self) -> int:
        return int(self.config.get("zero_optimization", {}).get("stage", 0))

    # -- set-up --------------------------------------------------------------------------
    def setup_environment(self) -> None:
        if not isinstance(self.precision_plugin, ZerocorePrecision):
            self.precision_plugin = ZerocorePrecision(getattr(self.precision_plugin, "precision", "32-true"))
        super().setup_environment()

    @contextmanager
    def model_sharded_context(self):
        cm = zerocore.init(self._engine_config(None)) if self.zero_stage == 3 else nullcontext()
        with cm:
            yield

    def setup(self, trainer: "pl.Trainer") -> None:
        self._give_back_engine(collective=True)  # a previous run's, had its teardown not run
        self.accelerator.setup(trainer)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        optimizer = groups = None
        if fitting:
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ValueError(f"zerocore strategy: configure_optimizers returned {len(self.optimizers)} "
                                 "optimizers; the engine steps exactly one")
            if len(self.lr_scheduler_configs) > 1:
                raise ValueError("zerocore strategy: at most one LR scheduler")
            optimizer = self.optimizers[0]
        if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE and trainer.gradient_clip_val:
            raise ValueError("zerocore strategy: gradient_clip_algorithm='value' is not supported; the engine "
                             "clips the global norm (gradient_clip_algorithm='norm')")
        config = self._engine_config(trainer)
        if optimizer is not None:
            section, groups = optimizer_section(optimizer)
            config.setdefault("optimizer", section)
        # validate / test / predict: an engine that trains nothing (no gradient buffer, master or optimizer state),
        # as Lightning's DeepSpeed strategy builds DeepSpeed's inference engine there
        self.engine = (initialize(self.lightning_module, config, groups) if fitting else
                       initialize(self.lightning_module, evaluation_config(config), frozen=True))
        self.precision_plugin.engine = self.engine
        if self.zero_stage == 3:
            _summaries_count_whole(trainer)
        if optimizer is not None:
            # the same group dicts: the scheduler's writes to the user's optimizer are what the engine reads
            self.optimizers = [EngineOptimizer(optimizer.param_groups)]
            # torch's schedulers warn when their optimizer's own step() never ran: the engine steps for it
            optimizer._opt_called = True
        self.setup_precision_plugin()

    def _engine_config(self, trainer) -> dict:
        cfg = copy.deepcopy(self.config)
        if trainer is not None:
            acc = trainer.accumulate_grad_batches
            if cfg.get("gradient_accumulation_steps", acc) != acc:
                raise ValueError(f"zerocore strategy: config gradient_accumulation_steps="
                                 f"{cfg['gradient_accumulation_steps']} vs Trainer accumulate_grad_batches={acc}; "
                                 "set one of them")
            cfg["gradient_accumulation_steps"] = acc
            cfg.pop("train_batch_size", None)  # Lightning's loader decides the batch; no second source
            clip = float(trainer.gradient_clip_val or 0.0)
            if "gradient_clipping" in cfg and trainer.gradient_clip_val is not None and cfg["gradient_clipping"] != clip:
                raise ValueError(f"zerocore strategy: config gradient_clipping={cfg['gradient_clipping']} vs Trainer "
                                 f"gradient_clip_val={trainer.gradient_clip_val}; set one of them")
            cfg.setdefault("gradient_clipping", clip)
        for key, value in _PRECISIONS[self.precision_plugin.precision
                                      if isinstance(self.precision_plugin, ZerocorePrecision) else "32-true"].items():
            cfg.setdefault(key, value)
        return cfg

    def _setup_model(self, model):
        return model  # no DDP wrapper: the engine's hooks reduce the gradients

    def configure_ddp(self) -> None:
        pass

    def pre_backward(self, closure_loss) -> None:
        pass

    def post_backward(self, closure_loss) -> None:
        pass

    @property
    def handles_gradient_accumulation(self) -> bool:
        return False  # Lightning skips optimizer_step inside a window; the precision plugin counts those

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine must exist to load its checkpoint

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine's checkpoint holds the optimizer state

    # -- checkpoints ---------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        if self.engine is None:
            raise RuntimeError("zerocore strategy: save_checkpoint() without an engine: the engine exists from "
                               "setup to the end of fit/validate/test/predict, whose teardown destroys it to give "
                               "its memory back (the model then holds the trained weights: save those with "
                               "torch.save(model.state_dict(), path)); save zerocore checkpoints during fit, e.g. "
                               "with ModelCheckpoint")
        if storage_options is not None:
            raise TypeError("zerocore strategy: storage_options is not supported (the engine writes the files)")
        filepath = self.broadcast(str(filepath))
        client = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        if self.optimizers:
            client[_GROUP_LRS] = [g["lr"] for g in self.optimizers[0].param_groups]
        self.engine.save_checkpoint(filepath, tag="checkpoint", client_state=client)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        path, client = self.engine.load_checkpoint(str(checkpoint_path), tag="checkpoint",
                                                   load_optimizer_states=fitting)
        if path is None or client is None:
            raise FileNotFoundError(f"zerocore strategy: no zerocore checkpoint at {checkpoint_path} (a directory "
                                    "written by this strategy's save_checkpoint)")
        lrs = client.pop(_GROUP_LRS, None)
        if lrs is not None and self.optimizers:
            for g, lr in zip(self.optimizers[0].param_groups, lrs):
                g["lr"] = lr
        return client

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # the engine loaded the weights in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            import shutil

            shutil.rmtree(filepath, ignore_errors=True)

    def teardown(self) -> None:
        # Lightning's Trainer, module and strategy reference each other (by Lightning's design), so
        # an engine left here would live until Python's cyclic collector ran, and a second fit would
        # add its memory to the first's. Destroyed at the end of each run instead: its buffers are
        # freed now and the model holds the trained weights as plain tensors, as after DDP.
        trainer = getattr(self.lightning_module, "_trainer", None)
        failed = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
        # after an error the other ranks may not be there for stage 3's gather
        self._give_back_engine(collective=not failed)
        super().teardown()

    def _give_back_engine(self, collective: bool) -> None:
        engine, self.engine = self.engine, None
        if isinstance(self.precision_plugin, ZerocorePrecision):
            self.precision_plugin.engine = None
        if engine is not None:
            engine.destroy(collective=collective)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("zerocore", cls, description="zerocore (stage from the config)", override=True)
        for name, kw in (("zerocore_stage_1", {"stage": 1}), ("zerocore_stage_2", {"stage": 2}),
                         ("zerocore_stage_2_offload", {"stage": 2, "offload_optimizer": True}),
                         ("zerocore_stage_3", {"stage": 3}),
                         ("zerocore_stage_3_offload", {"stage": 3, "offload_optimizer": True,
                                                       "offload_parameters": True})):
            strategy_registry.register(name, cls, description=f"zerocore {name[9:].replace('_', ' ')}",
                                       override=True, **kw)


ZerocoreStrategy.register_strategies(StrategyRegistry)

__all__ = ["ZerocoreStrategy", "ZerocorePrecision", "LIGHTNING_VERSION"]
