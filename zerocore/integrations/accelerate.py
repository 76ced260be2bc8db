"""Accelerate driving zerocore: ``ZeroAccelerator(zerocore_config=cfg, ...)`` in place of ``Accelerator``.

A subclass that overrides Accelerate's public preparation and training methods (nothing in the
library is patched; Accelerate's own DeepSpeed route is not used):

- ``prepare(model, optimizer, loader, scheduler)``: the model and the (Adam/AdamW) optimizer build
  the engine (a model with no optimizer, and no ``optimizer`` section in the config: an engine that
  trains nothing, for evaluation, as Accelerate's DeepSpeed route builds DeepSpeed's inference
  engine); the model comes back as a module whose forward is the engine's (no DDP), the
  optimizer as Accelerate's wrapper of a face whose ``param_groups`` the scheduler writes and the
  engine reads, whose ``step``/``zero_grad`` do nothing; loaders and schedulers as Accelerate does;
- ``backward(loss)``: the engine's backward, then its step, which updates where Accelerate syncs
  (``sync_gradients``: every ``gradient_accumulation_steps`` micro-batches inside ``accumulate()``,
  and at the loader's end, a short window);
- ``free_memory()`` / ``clear()``: the engine destroyed (its memory given back at once), as
  Accelerate does with DeepSpeed's;
- ``clip_grad_norm_``: the engine clips (set ``gradient_clipping`` in the config); returns its norm;
- ``get_state_dict`` / ``save_state`` / ``load_state``: full weights gathered from the shards, and
  zerocore checkpoints (loadable at another world size).
"""
from __future__ import annotations

import torch

from ._common import (EngineOptimizer, backward_at, check_version, compile_as_accelerate, global_grad_norm, initialize,
                      optimizer_section, sync_lr)

ACCELERATE_VERSION = check_version("accelerate", "1.0", "2", "zerocore.integrations.accelerate")

from accelerate import Accelerator  # noqa: E402

from ..runtime.off_stack import import_off_stack  # noqa: E402
from ._wrapping import EngineModule, read_config  # noqa: E402

# The first torch optimizer a process builds imports torch._dynamo, and that import leaves a cycle
# holding the frames it ran under (runtime/off_stack.py): the user's function that goes on to hold
# this Accelerator and its engine, kept alive after it returns. Transformers and Lightning import
# torch._dynamo with themselves; Accelerate does not, so it is imported here, on a thread of its own.
import_off_stack()


class ZeroAccelerator(Accelerator):
    def __init__(self, *args, zerocore_config=None, **kwargs):
        if zerocore_config is None:
            raise TypeError("ZeroAccelerator needs zerocore_config= (a zerocore/DeepSpeed config dict or JSON path)")
        super().__init__(*args, **kwargs)
        self.zerocore_config = read_config(zerocore_config)
        self.zerocore_engine = None
        self._zc = {}  # id(user's object) -> what prepare returns for it, during one prepare() call

    def prepare(self, *args, device_placement=None):
        models = [a for a in args if isinstance(a, torch.nn.Module)]
        opts = [a for a in args if isinstance(a, torch.optim.Optimizer)]
        try:
            if models:
                if len(models) > 1 or len(opts) > 1 or self.zerocore_engine is not None:
                    raise ValueError("ZeroAccelerator: one model and at most one optimizer, prepared once (after "
                                     "free_memory(), once more)")
                self._build(models[0], opts[0] if opts else None)
            return super().prepare(*args, device_placement=device_placement)
        finally:
            self._zc.clear()  # keyed by id(): only meaningful while this call holds the objects

    def _build(self, model, optimizer) -> None:
        cfg = dict(self.zerocore_config)
        acc = self.gradient_accumulation_steps
        if cfg.get("gradient_accumulation_steps", acc) != acc:
            raise ValueError(f"ZeroAccelerator: config gradient_accumulation_steps={cfg['gradient_accumulation_steps']}"
                             f" vs Accelerator gradient_accumulation_steps={acc}; set one of them")
        cfg["gradient_accumulation_steps"] = acc
        cfg.pop("train_batch_size", None)  # the prepared loader decides the batch
        groups = None
        if optimizer is not None:
            section, groups = optimizer_section(optimizer)
            cfg.setdefault("optimizer", section)
        # a model prepared with no optimizer, and none in the config: Accelerate's DeepSpeed route builds DeepSpeed's
        # inference engine; so here, an engine that trains nothing (at stage 3 its weights partitioned)
        engine = initialize(model, cfg, groups, frozen=optimizer is None and "optimizer" not in cfg)
        compile_as_accelerate(engine, self)  # dynamo_backend / dynamo_plugin: as Accelerate's DeepSpeed route
        self.zerocore_engine = engine
        self._zc[id(model)] = EngineModule(engine)
        if optimizer is not None:
            self._zc[id(optimizer)] = EngineOptimizer(optimizer.param_groups)
            optimizer._opt_called = True  # torch's schedulers: the engine steps for this optimizer

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        mine = self._zc.get(id(model))
        if mine is None:
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        self._models.append(mine)
        return mine

    def prepare_optimizer(self, optimizer, device_placement=None):
        face = self._zc.get(id(optimizer))
        if face is None:
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        # no device placement: it reloads the state dict, which would give the face new group dicts
        # and cut it off from the scheduler that writes the user's optimizer's groups
        return super().prepare_optimizer(face, device_placement=False)

    def backward(self, loss, **kwargs) -> None:
        engine = self.zerocore_engine
        if engine is None:
            return super().backward(loss, **kwargs)
        # accumulate() decides the boundary: every gradient_accumulation_steps micro-batches and at
        # the loader's end (a short window); the engine divides by the accumulation steps, as
        # Accelerate divides on DDP, a short window too
        boundary = self.sync_gradients
        backward_at(engine, loss, boundary, divided=False)
        if boundary and self._optimizers:
            sync_lr(engine, self._optimizers[0])
        engine.step()

    def free_memory(self, *objects):
        """Accelerate's ``free_memory`` (``clear``), and the engine destroyed as Accelerate destroys
        DeepSpeed's: its buffers freed now, the model given back with its full weights (a collective
        at stage 3: every rank calls it). A later ``prepare`` builds a new engine."""
        engine = self.zerocore_engine
        self.zerocore_engine = None
        self._zc.clear()
        if engine is not None:
            engine.destroy()
        return super().free_memory(*objects)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        if self.zerocore_engine is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        clip = self.zerocore_engine.config.gradient_clipping
        if float(max_norm) != clip:
            raise ValueError(f"ZeroAccelerator: clip_grad_norm_(max_norm={max_norm}) but the engine clips at config "
                             f"gradient_clipping={clip}; set gradient_clipping in the zerocore config")
        norm = global_grad_norm(self.zerocore_engine)
        return torch.tensor(norm if norm is not None else 0.0)

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        if isinstance(model, EngineModule):
            return model.module
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(self, model, unwrap=True):
        if self.zerocore_engine is None:
            return super().get_state_dict(model, unwrap)
        return self.zerocore_engine.full_state_dict()  # a collective: every rank calls it

    def save_state(self, output_dir: str | None = None, **kwargs):
        if self.zerocore_engine is None:
            return super().save_state(output_dir, **kwargs)
        self.zerocore_engine.save_checkpoint(output_dir, client_state={
            "schedulers": [s.state_dict() for s in self._schedulers],
            "group_lrs": [g["lr"] for g in self._optimizers[0].param_groups] if self._optimizers else []})
        return output_dir

    def load_state(self, input_dir: str | None = None, **kwargs):
        if self.zerocore_engine is None:
            return super().load_state(input_dir, **kwargs)
        path, client = self.zerocore_engine.load_checkpoint(input_dir)
        if path is None:
            raise FileNotFoundError(f"ZeroAccelerator: no zerocore checkpoint in {input_dir}")
        for s, state in zip(self._schedulers, client.get("schedulers", [])):
            s.load_state_dict(state)
        if self._optimizers:
            for g, lr in zip(self._optimizers[0].param_groups, client.get("group_lrs", [])):
                g["lr"] = lr


__all__ = ["ZeroAccelerator", "ACCELERATE_VERSION"]
