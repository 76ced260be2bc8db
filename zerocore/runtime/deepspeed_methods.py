"""The methods and attributes DeepSpeed's engine offers scripts and trainers, with DeepSpeed 0.19's
meanings, mixed into :class:`zerocore.Engine`.

They read the engine's state; the training loop itself (``backward``, ``step``) stays in
``engine.py`` and asks :meth:`is_gradient_accumulation_boundary` and ``_in_no_sync`` here.
"""
from __future__ import annotations

import contextlib
import logging
import os
import stat

import torch

from ..sharding.gatherer import Running
from . import coalesced_reduction, provided
from .checkpoint_marks import wait_pending
from .misuse import NoSyncMisuse
from .offload_states import check_resident


class DeepSpeedMethods:
    # class-level defaults: the engine sets these as instance attributes when they change
    _boundary_override: bool | None = None  # set_gradient_accumulation_boundary(); None: the counter decides
    _window_start: int | None = None  # micro_steps at the last boundary; None: none since built or loaded
    _in_no_sync = False
    _coalescing = False  # inside coalesce_grad_reduction() (runtime/coalesced_reduction.py)
    pipeline_parallelism = False  # DeepSpeed's flag (its PipelineEngine's): zerocore has no pipeline engine
    _in_step = False  # step() is running: the boundary of managed_gradient_accumulation: false (unmanaged_window.py)
    _window_backwards = 0  # backward() calls since the last step(), counted where accumulation is unmanaged
    global_samples = 0  # samples of the global batches stepped so far (skipped steps included, as DeepSpeed)
    training_dataloader = None
    # zerocore.deepspeed.initialize's mark: where its engines follow DeepSpeed rather than zerocore
    # (zerocore/deepspeed/semantics.py); None for zerocore.initialize's
    deepspeed_semantics = None

    # -- accumulation ---------------------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the micro-batch under way ends an accumulation window (its step() updates): the
        value given to :meth:`set_gradient_accumulation_boundary`, else the micro-step counter."""
        if not self.config.managed_gradient_accumulation:
            return self._in_step  # the caller's step() ends the window (runtime/unmanaged_window.py)
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gas == 0

    @property
    def _is_gradient_accumulation_boundary(self) -> bool | None:
        """DeepSpeed's attribute: the value set_gradient_accumulation_boundary() gave (None: never set)."""
        return self._boundary_override

    def managed_gradient_accumulation(self) -> bool:
        """DeepSpeed's: whether the engine ends accumulation windows itself (every gradient_accumulation_steps
        micro-batches) or the caller's step() does (``managed_gradient_accumulation: false``)."""
        return self.config.managed_gradient_accumulation

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Overrides the counter: the next backward/step pairs are (True) or are not (False) the end of
        the window, until set again. As in DeepSpeed, the loss is still divided by
        ``gradient_accumulation_steps``. Trainers set it before each backward, so a window that the
        trainer ends early (an epoch's last, short one) updates where the trainer steps."""
        if not self.config.managed_gradient_accumulation:
            raise NoSyncMisuse("zerocore: set_gradient_accumulation_boundary() with managed_gradient_accumulation: "
                               "false, where step() itself ends every window (DeepSpeed: "
                               "set_gradient_accumulation_boundary() is not supported with "
                               "managed_gradient_accumulation=False)")
        if not isinstance(is_boundary, bool):
            raise TypeError(f"zerocore: set_gradient_accumulation_boundary takes a bool; got "
                            f"{type(is_boundary).__name__}")
        self._boundary_override = is_boundary

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches whose backward does not reduce gradients across ranks (each rank accumulates
        its own; the next backward outside the context reduces the sum). Stages 0 and 1 only: stages
        2 and 3 keep only each rank's slice of the gradients, so every backward must reduce, and
        step() is refused inside the context, both as in DeepSpeed."""
        stage = self.zero_optimization_stage()
        if stage >= 2:
            raise NoSyncMisuse(f"zerocore: no_sync() is incompatible with ZeRO stage {stage}: its gradients are "
                               "partitioned, so every backward reduces them across ranks; use stage 0 or 1, or "
                               "gradient_accumulation_steps to accumulate without a step (DeepSpeed: no_sync context "
                               f"manager is incompatible with gradient partitioning logic of ZeRO stage {stage})")
        if self._in_no_sync or self._coalescing:
            raise NoSyncMisuse("zerocore: no_sync() entered again inside no_sync() or coalesce_grad_reduction(); "
                               "nesting is not supported (DeepSpeed: no_sync context manager reentry is unsupported)")
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    def coalesce_grad_reduction(self):
        """DeepSpeed 0.19's context manager: the backwards inside reduce nothing, leaving the block reduces their
        sum once (runtime/coalesced_reduction.py); call step() after the block."""
        return coalesced_reduction.coalesced(self)

    def gradient_accumulation_steps(self) -> int:
        return self.gas

    def train_micro_batch_size_per_gpu(self) -> int | None:
        return self.config.batch_sizes(self.comm.world)[1]

    def train_batch_size(self) -> int | None:
        return self.config.batch_sizes(self.comm.world)[2]

    def _mid_window(self) -> bool:
        """Whether micro-batches were accumulated since the last boundary (gradients not yet applied).
        Windows end where the boundary says, which with :meth:`set_gradient_accumulation_boundary`
        need not be every ``gradient_accumulation_steps`` micro-batches: so counted from the last
        boundary, and by the counter only before the first one (a fresh or just-loaded engine)."""
        if self._backward_done:
            return True
        if self._window_start is None:
            return self.micro_steps % self.gas != 0
        return self.micro_steps != self._window_start

    def _count_samples(self) -> None:
        """At each boundary (updated or skipped), as DeepSpeed counts global_samples; also marks where
        the next window starts (:meth:`_mid_window`)."""
        self._window_start = self.micro_steps
        batch = self.train_batch_size()
        if not self.config.managed_gradient_accumulation:  # the micro-batches the caller's window had
            batch = None if batch is None else batch // self.gas * self._window_backwards
            self._window_backwards = 0
        if batch is not None:
            self.global_samples += batch

    # -- facts ------------------------------------------------------------------------------
    _boundary_step = -1  # micro_steps after the last step() that ended an accumulation window (engine.step)

    def was_step_applied(self) -> bool:
        """DeepSpeed's: whether the last ``step()`` updated the parameters (False between accumulation
        boundaries and where the update was skipped for Inf/NaN gradients)."""
        return self._boundary_step == self.micro_steps and not self.overflow

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last boundary, before clipping (None before the first)."""
        return self.global_grad_norm

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.zero_optimization_stage() >= 3

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    def zero_offload_optimizer(self) -> bool:
        return self.config.zero_optimization.offload_optimizer.device != "none"

    def zero_offload_param(self) -> bool:
        return self.config.zero_optimization.offload_param.device != "none"

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def _get_zero_param_shapes(self) -> list:
        """DeepSpeed's: for each flat group (a stage-3 unit, or a stage 1-2 bucket), an ordered map of its trained
        parameters' names (the first a tied weight has in the state dict) to their full shapes, in the order the
        group's flat fp32 master holds them."""
        from collections import OrderedDict

        names: dict[int, str] = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            names.setdefault(id(t), name)
        return [OrderedDict((names[id(p)], torch.Size(s.shape)) for p, s in zip(g.params, g.layout.slots))
                for g in self.groups]

    def torch_autocast_enabled(self) -> bool:
        return self.config.torch_autocast.enabled

    def torch_autocast_dtype(self):
        """The forward's autocast dtype (torch's default for the device where the section names none)."""
        from .forward_autocast import autocast_dtype

        return autocast_dtype(self.config.torch_autocast, self.device.type)

    def torch_autocast_lower_precision_safe_modules(self) -> list[str]:
        """The section's list, else DeepSpeed's default (Linear and Conv): the classes DeepSpeed communicates in the
        autocast dtype (zerocore communicates every parameter in the training dtype)."""
        from ..deepspeed.runtime.torch_autocast import get_default_autocast_lower_precision_modules

        names = self.config.torch_autocast.lower_precision_safe_modules
        return list(names) if names is not None else get_default_autocast_lower_precision_modules()

    @property
    def global_rank(self) -> int:
        return self.comm.rank

    @property
    def local_rank(self) -> int:
        """The rank on this node: torchrun's LOCAL_RANK, else the global rank (one node)."""
        return int(os.environ.get("LOCAL_RANK", self.comm.rank))

    @property
    def dp_world_size(self) -> int:
        return self.comm.world

    @property
    def mp_world_size(self) -> int:
        return 1

    # -- weights ----------------------------------------------------------------------------
    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """Stage 3: the full weights in the training dtype, on CPU, as an ordered state dict on rank 0
        (None on the others). A collective."""
        from collections import OrderedDict

        from . import weights

        if self.zero_optimization_stage() != 3:
            raise ValueError("zerocore: _zero3_consolidated_16bit_state_dict requires ZeRO stage 3 (at stages 0-2 "
                             "the module's own state_dict() holds the full weights)")
        state = weights.full_state_dict(self, self.dtype)
        if self.comm.rank != 0:
            return None
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return OrderedDict(state)

    def empty_partition_cache(self) -> None:
        """DeepSpeed's: stage 3 frees the full parameters still gathered outside a forward/backward
        (units kept for reuse: stage3_max_reuse_distance), so each rank holds only its chunks and the
        persistent parameters; the device's cached blocks go back too. Nothing to free at stages 0-2.
        Called inside a forward or backward it is refused (the pass needs what it gathered)."""
        g = self.gatherer
        if g is None:
            return
        if g.running is not Running.IDLE:
            raise RuntimeError("zerocore: empty_partition_cache() inside a forward or backward pass; call it between "
                               "training steps")
        for u in g.units:
            g._free(u)  # the unit back to its chunk (pending post-backward signals stay counted)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- checkpoints (zerocore/checkpoint/, a floor above: reached through runtime/provided.py) --
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False, async_save: bool = False):
        """DeepSpeed's ``save_checkpoint``: every rank writes the optimizer state it owns, rank 0 the
        manifest; ``save_dir/<tag>`` (default ``global_step<N>``) appears, and ``save_dir/latest``
        names it (unless ``save_latest`` is false), only once complete. A collective. Returns the
        tag directory; with ``async_save`` a handle whose ``wait()`` returns it (the state is copied
        to host memory and written in the background; the next ``step`` waits for the copy, the
        next save or load for the whole save).
        ``exclude_frozen_parameters`` is accepted: frozen parameters are always saved (they are
        whole on rank 0 and small beside the optimizer state), so a load finds them."""
        if save_dir is None or not os.fspath(save_dir):
            raise ValueError(f"zerocore: save_checkpoint needs a directory to save into; got {save_dir!r}")
        check_resident(self, "save_checkpoint()")
        if async_save:
            return provided.call("save_async", self, save_dir, tag, client_state, save_latest=save_latest)
        wait_pending(self)
        return provided.call("save_checkpoint", self, save_dir, tag, client_state, save_latest=save_latest)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False, custom_load_fn=None,
                        in_place: bool | None = None):
        """DeepSpeed's ``load_checkpoint``: ``(path, client_state)``; ``(None, None)`` with a warning
        when ``tag`` is None and there is no checkpoint. Loads a checkpoint of any world size and
        stage. ``load_module_only``: weights only (optimizer, counters, lr and scaler stay as they
        are). ``load_lr_scheduler_states``: restore the schedule's state too. A collective.
        ``load_module_strict=False`` is refused: a checkpoint of another model is always an error
        naming its differences. ``custom_load_fn`` is not supported. ``in_place``: read straight
        into the optimizer state, no staging (``zerocore/checkpoint/load_in_place.py``): None (the
        default) where the engine has not trained yet (a resume), True always, False never; a
        failed in-place load leaves the state partly overwritten and the engine refusing to step
        until a load succeeds, a staged one leaves the engine unchanged."""
        if not load_module_strict:
            raise ValueError("zerocore: load_checkpoint(load_module_strict=False) is not supported: the checkpoint "
                             "must hold the same model (its differences are named); load the weights yourself with "
                             "zerocore.gathered(..., modifier_rank=0) to copy a partial state dict")
        if custom_load_fn is not None:
            raise ValueError("zerocore: load_checkpoint(custom_load_fn=...) is not supported")
        check_resident(self, "load_checkpoint()")
        wait_pending(self)
        if self.deepspeed_semantics is not None:
            tag = self.deepspeed_semantics.universal_tag(load_dir, tag)
            self.deepspeed_semantics.before_load(self, load_dir, tag, load_optimizer_states, load_module_only)
        return provided.call("load_checkpoint", self, load_dir, tag, load_optimizer_states, load_module_only,
                             load_lr_scheduler_states=load_lr_scheduler_states, in_place=in_place)

    def _change_recovery_script_permissions(self, dst) -> None:
        """DeepSpeed's: adds the user's execute bit to ``dst`` (the ``zero_to_fp32.py`` a save leaves
        in its folder; zerocore's save sets it already, ``zerocore/checkpoint/recovery.py``). A file
        that is missing or whose mode cannot change is logged (``deepspeed.utils.logger.info``, the
        "DeepSpeed" logger), not raised, as DeepSpeed does (file shares without modes)."""
        try:
            os.chmod(dst, os.stat(dst).st_mode | stat.S_IEXEC)
        except (FileNotFoundError, PermissionError) as e:
            logging.getLogger("DeepSpeed").info(f"Warning: Could not change permissions for {dst} due to error: {e}. "
                                                "Continuing without changing permissions.")

    def _get_optimizer_ckpt_name(self, checkpoints_path, tag, expp_rank=None) -> str:
        """The file of a checkpoint tag that holds this rank's optimizer state (DeepSpeed's method;
        zerocore's layout: one file per rank, ``zerocore/checkpoint/layout.py``)."""
        return os.path.join(os.fspath(checkpoints_path), str(tag), provided.call("rank_file", self.comm.rank))

    # -- DeepSpeed's engine attributes that have nothing to do here ---------------------------
    sparse_tensor_module_names: frozenset = frozenset()  # zerocore reduces dense gradients only

    def allreduce_gradients(self, bucket_size=None) -> None:
        """DeepSpeed's explicit reduction: zerocore's ``backward()`` reduces the gradients itself (at
        the accumulation boundary at stages 0/1, every micro-batch at 2/3), so there is nothing left
        to reduce when a script calls this after it."""
        self._alive()

    # -- lifecycle (train()/eval() are nn.Module's: the engine and the wrapped model) ----------
    def compile(self, backend=None, compile_kwargs=None, schedule=None, compiled_autograd_enabled: bool = False):
        """``torch.compile`` of the wrapped module's forward; at stage 3 of each unit's forward on its
        own (``ParamGatherer.compile_units``: FSDP2's recipe, the gather/free hooks eager around each
        unit's graph, the glue between units eager). Called once; returns nothing, as DeepSpeed's."""
        if self.is_compiled:
            return
        kwargs = dict(compile_kwargs or {})
        if backend is not None:
            kwargs["backend"] = backend
        units = self.gatherer.compile_units(**kwargs) if self.gatherer is not None else []  # stage 3, glue eager
        if not units:  # stages 0-2 (or a stage-3 model with no unit below the root): the whole module
            self.module.compile(**kwargs)
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        return getattr(self, "_is_compiled", False)

    def get_accelerator_device_name(self) -> str:
        return self.device.type


def build_dataloader(dataset, micro_batch: int | None, comm, collate_fn=None, drop_last: bool = False):
    """DeepSpeed's training loader: each data-parallel rank reads its part of ``dataset`` through a
    ``DistributedSampler`` with torch's defaults (shuffled with seed 0, the same order every epoch
    unless ``loader.sampler.set_epoch`` is called), ``micro_batch`` samples per batch, the same
    batches DeepSpeed's loader yields (read in the main process)."""
    from torch.utils.data import DataLoader, Dataset, IterableDataset
    from torch.utils.data.distributed import DistributedSampler

    if not isinstance(dataset, (Dataset, IterableDataset)):
        raise ValueError(f"zerocore: training_data must be a torch.utils.data.Dataset; got {type(dataset).__name__}")
    if micro_batch is None:
        raise ValueError("zerocore: training_data needs the micro-batch size: set train_micro_batch_size_per_gpu "
                         "(or train_batch_size) in the config")
    sampler = DistributedSampler(dataset, num_replicas=comm.world, rank=comm.rank)
    return DataLoader(dataset, batch_size=micro_batch, sampler=sampler, collate_fn=collate_fn, drop_last=drop_last,
                      pin_memory=torch.cuda.is_available())
