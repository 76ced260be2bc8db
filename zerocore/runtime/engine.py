"""The engine users drive: forward, backward(loss), step(), with DeepSpeed's semantics.

``backward`` and ``step`` are called every micro-batch; the loss is divided by the
accumulation steps and the optimizer updates at each accumulation boundary. Ranks' gradients
are summed by the collectives and the 1/world average, the fp16 unscale and the clip
coefficient are folded into the Adam kernel's ``grad_scale``: no extra pass over gradients.
"""
from __future__ import annotations

import math
import warnings

import torch

from .. import ops
from ..ops.params import param_ops
from .._transforms import peek_interpreter_stack
from .._weak import weak_call
from ..profiling import label
from ..comm import Comm
from ..config import ZeroConfig
from ..comm.divergence import DivergenceGuard, Op
from ..offload import OffloadPlan
from ..offload.host_batch import HOST_BATCH_ELEMS, HostRuns, batchable
from ..offload import speculation
from ..sharding import (AdamHyper, GradReducer, OptimizerShard, ParamState, ShardedGroup,
                        policy_for)
from ..sharding.gatherer import Limits, ParamGatherer
from ..sharding.optimizer import MultiShardStep, owned_grads
from .loss_scale import LossScaler
from .memory import held_bytes, with_prediction
from .grad_norm import reduce_dtype
from .update_coef import boundary_coef
from .deferred_skip import PendingSkip, SettledCount, settle
from .model_setup import accumulation_dtype, convert_rest, named_params, training_dtype
from .forward_autocast import forward_autocast
from .gathered import register_engine
from .partition_init import check_unchanged, initial_value
from .group_specs import GroupSpec, engine_groups, hyper_pieces
from .frozen_groups import build_frozen_group, frozen_specs, gatherer_units, whole_frozen
from .client_optimizer import check_torch_optimizer, classify as classify_optimizer
from .optimizer_face import ZeroOptimizer
from .torch_shard_step import TorchBatch, TorchShardStep
from .param_groups import resolve as resolve_groups
from .. import schedules
from . import weights
from .agreement import agree
from .misuse import (NoSyncMisuse, RequiresGradWatch, check_loss, checked_lr, explain_dtype_error,
                     keeps_counters_on_failure, note_empty_parameter, own_module_zero_grad, reports_stalls,
                     upcast_from)
from .preflight import check_config, check_model
from .off_stack import import_off_stack
from . import offload_states as states_aside
from .release import DESTROYED, EngineDestroyed, forget_state, release
from .shutdown import close_engine
from ..comm.lifetime import engine_started
from .deepspeed_methods import DeepSpeedMethods
from .throughput import ThroughputTimer
from . import ds_param_attrs
from .module_face import ModuleFace
from . import provided
from ..debug.engine_waits import watch_engine
from . import coalesced_reduction, torch_backward, unmanaged_window
from .backward_bracket import AUTOGRAD, ENGINE, BackwardBracket
from .group_labels import GroupLabels
from .torch_backward import AutogradBackward
from . import trains_nothing
from .host_heap import give_back_freed


class Engine(DeepSpeedMethods, BackwardBracket, AutogradBackward, ModuleFace, torch.nn.Module):
    """A ``torch.nn.Module`` wrapping the model (registered as ``module``), as DeepSpeed's engine is:
    ``parameters()``, ``named_parameters()``, ``state_dict()`` (keys ``module.<name>``), hooks,
    ``train()``/``eval()`` act on the wrapped model (``module_face.py`` for the rest)."""

    def __init__(self, module: torch.nn.Module, config: ZeroConfig, comm: Comm, *, model_parameters=None,
                 optimizer=None, lr_scheduler=None, trains: bool = True):
        """``model_parameters``: the parameters to train, or hyper-parameter groups (``param_groups.py``);
        ``optimizer``: a client optimizer (``client_optimizer.py``); ``lr_scheduler``: a client
        schedule (``zerocore.schedules``); ``trains`` False: the engine trains nothing (``trains_nothing.py``).
        See ``zerocore.initialize``."""
        torch.nn.Module.__init__(self)  # before any attribute: nn.Module keeps its registries in __dict__
        import_off_stack()  # before anything here can be caught in a cycle of torch's (off_stack.py)
        # every rank checks its model and config, then all compare them: any failure raises on every rank
        self._tag = agree(comm, module, config, lambda: (check_config(config), check_model(module)))
        self.module = module
        self.config = config
        self.comm = comm
        z = config.zero_optimization
        self.policy = policy_for(z.stage, accumulation_dtype(config))
        self.dtype = training_dtype(config)
        self.gas, _, _ = config.batch_sizes(comm.world)
        trainable, frozen = named_params(module)
        # nothing to train (a reference or evaluation model): every parameter frozen, no optimizer state
        self.trains = trains_nothing.trains(trains, trainable, frozen, optimizer, model_parameters, lr_scheduler)
        if self.trains:
            client = classify_optimizer(optimizer, config, lambda: model_parameters if model_parameters is not None
                                        else [p for _, p in trainable])
            hyper = resolve_groups(module, client.optimizer.param_groups if client.optimizer is not None
                                   else model_parameters, client.defaults,
                                   source="optimizer.param_groups" if client.optimizer is not None
                                   else "model_parameters",
                                   checked=("lr", "betas", "eps", "weight_decay") if client.fused_adam else ("lr",))
        else:
            trainable, frozen, client, hyper = trains_nothing.everything_frozen(module, config)
        if not client.fused_adam:
            check_torch_optimizer(client, config)
        # requires_grad parameters in no group are not trained: kept whole, like frozen ones
        self._ungrouped = hyper.ungrouped
        skip = {id(p) for _, p in hyper.ungrouped}
        trainable = [(n, p) for n, p in trainable if id(p) not in skip]
        self.device = (trainable + frozen)[0][1].device
        self._autocast = forward_autocast(config, self.device)  # torch_autocast: (device type, dtype) or None
        self._upcast = upcast_from(trainable, self.dtype)  # a 16-bit model trained in fp32: warned, named on errors
        self._requires_grad = RequiresGradWatch(trainable, frozen)
        own_module_zero_grad(self)
        # CPU offload: where the optimizer shard (and stage-3 parameter shards) rest; None: the device
        self.offload = OffloadPlan.build(config, self.device, weak_call(self.is_gradient_accumulation_boundary))
        # offload's gradient norm is host data: summed over ranks through gloo, not through device memory
        self._host_comm = comm.host_side() if self.offload is not None else comm
        for names, p in trainable + frozen:
            check_unchanged(p, names[0])
        self.groups: list[ShardedGroup] = []
        self.shards: list[OptimizerShard] = []
        self.gatherer: ParamGatherer | None = None
        units = []
        specs, cold = frozen_specs(self._group_specs(module, trainable, z, hyper.index, frozen))
        for spec in specs:
            g = self._add_group(spec.layout, spec.params, spec.policy)
            self.shards[-1].pieces = hyper_pieces(spec, g.lo, g.hi)
            if spec.unit is not None:
                units.append((spec.unit[0], spec.unit[1], g))
        # stage 3: frozen parameters partitioned per unit (frozen_groups.py); the others stay whole
        self.frozen_groups = [build_frozen_group(s, comm, self.device, self.offload) for s in cold]
        convert_rest(module, whole_frozen(frozen, self.frozen_groups) + hyper.ungrouped, self.dtype, comm,
                     config.data_types)
        # which group and slot hold each parameter (zerocore.gathered finds them here)
        self.param_index = {id(p): (g.index, i) for g in self.groups + self.frozen_groups
                            for i, p in enumerate(g.params)}
        register_engine(self)
        # Stage 3: every collective is checked first against the other ranks' (divergence).
        self._labels = GroupLabels()  # filled below, once the units exist: plain strings, no engine reference
        self.guard = DivergenceGuard(comm, self._labels, enabled=z.stage == 3 and z.stage3_check_divergence,
                                     timeout_s=z.stage3_divergence_timeout)
        if z.stage == 3:
            self.gatherer = ParamGatherer(module, gatherer_units(units, list(zip(cold, self.frozen_groups))),
                                          comm, self.guard, Limits(
                prefetch_elems=z.stage3_prefetch_bucket_size, max_live=z.stage3_max_live_parameters,
                max_reuse=z.stage3_max_reuse_distance))
            provided.call("adopt_model", self)  # client libraries' rules for sharded models (Transformers' generate)
        # peers signal each other through weak calls: the engine owns all three
        self.reducer = GradReducer(self.groups, comm, overlap=z.overlap, reduce_scatter=z.reduce_scatter,
                                   device=self.device, guard=self.guard if self.guard.enabled else None,
                                   on_complete=weak_call(self.gatherer.on_group_complete) if self.gatherer else None,
                                   on_reduced=weak_call(self.offload.on_reduced) if self.offload else None,
                                   reduce_dtype=reduce_dtype(z.reduce_dtype, self.dtype),
                                   unit_signals=self.gatherer is not None,
                                   outside=weak_call(self._opened_late))
        if self.gatherer is not None:
            self.gatherer.on_unit_done = weak_call(self.reducer.group_done)
            self.gatherer.on_outside = weak_call(self._opened_late)
        self._labels.fill(self.groups, self.gatherer)
        # fp16's hysteresis as DeepSpeed applies it: at its ZeRO stages, not at stage 0 (runtime/loss_scale.py)
        self.scaler = LossScaler(config.fp16 if config.fp16.enabled else None, hysteresis=z.stage > 0)
        # skip an update whose gradients hold Inf/NaN: the one host read of a step (fp16; bf16 if asked)
        self._checks_overflow = config.fp16.enabled or (config.bf16.enabled and config.bf16.check_grad_overflow)
        # the optimizer face: its param_groups are the hyper-parameter groups the update reads
        self.optimizer = ZeroOptimizer(self, hyper.groups, client.defaults, decoupled=client.decoupled,
                                       shared=client.optimizer.param_groups if client.optimizer is not None else None)
        self.client_optimizer = client.optimizer
        # a client optimizer other than Adam steps the flat fp32 shards itself
        self._torch_step = (None if client.fused_adam else
                            TorchShardStep(client.optimizer, self.shards, self.optimizer.param_groups))
        self.overflow = False  # the last accumulation boundary skipped its update
        self.lr_scheduler = schedules.client_schedule(lr_scheduler, self.optimizer, client.optimizer)
        if self.lr_scheduler is None:  # a client schedule wins over the config's section (DeepSpeed's rule)
            self.lr_scheduler = schedules.from_config(config.scheduler.type, config.scheduler.params, self.optimizer)
        self.micro_steps = 0
        self.global_steps = 0  # accumulation boundaries reached (including skipped updates)
        self.optimizer_steps = 0  # updates applied (Adam's step count)
        self._zc_pending_save = None  # an asynchronous save in flight (checkpoint/async_save.py)
        self._zc_state_lost = None  # a failed load overwrote part of the optimizer state (checkpoint/load.py)
        self.skipped_steps = 0
        self.global_grad_norm: float | None = None
        self._backward_done = False
        self._dropped = False  # zero_grad() between backward() and step() (named by step())
        # the hook every forward puts on its outputs, to see a loss.backward() (runtime/torch_backward.py)
        self._output_hook = (torch_backward.output_hook(self) if self.trains else trains_nothing.output_hook(self))
        self._call_before = param_ops().call_before_node  # (the native extension is loaded by now)
        self._batches = self._step_batches()  # after the face and _torch_step: the batches use them
        self._speculations = speculation.attach(self, self._batches)  # offload_optimizer.speculative_step
        self._pending_skip: PendingSkip | None = None
        self.skip_on_overflow(self._checks_overflow)
        self.tput_timer = ThroughputTimer(self.train_batch_size())  # DeepSpeed's samples/s (throughput.py)
        if z.stage == 3:
            ds_param_attrs.attach(self)  # DeepSpeed's ds_* attributes, which third-party code reads
        if not config.managed_gradient_accumulation:  # step() marks the boundary around itself (weakly: no cycle)
            self.step = weak_call(self._unmanaged_step)
        watch_engine(self)  # ZEROCORE_DEBUG_HOST_WAITS: each step's host waits (zerocore/debug/engine_waits.py)
        engine_started(self)  # the process groups zerocore created live while an engine does
        give_back_freed()  # what the build freed leaves the resident set too (host_heap.py)

    def _group_specs(self, module, trainable, z, hyper: dict[int, int], frozen=()) -> list[GroupSpec]:
        return engine_groups(module, trainable, z, self.comm.world, self.dtype, self.policy, hyper, frozen)

    def _add_group(self, layout, params, policy) -> ShardedGroup:
        # The initial values, in fp32, broadcast from rank 0 so every rank starts identical;
        # the fp32 master is cut from them before the parameters are rounded to 16 bits.
        init = torch.zeros(layout.padded, dtype=torch.float32, device=self.device)
        rounded = self.dtype != torch.float32 and self.config.data_types.master_init == "rounded"
        for slot, p in zip(layout.slots, params):
            value = initial_value(p, self.comm)
            init[slot.offset:slot.end] = value.to(self.dtype) if rounded else value  # (DeepSpeed's master: rounded)
        self.comm.broadcast(init)
        if self.dtype == torch.float32:
            flat = init
        else:
            flat = ops.cast(init, torch.empty(layout.padded, dtype=self.dtype, device=self.device))
        g = ShardedGroup(layout, params, policy, self.comm.rank, self.device, param_flat=flat)
        tile = self.config.zero_optimization.sub_group_size if self.config.zero_optimization.stage == 3 else None
        self.shards.append(self.offload.make_shard(g, init, tile) if self.offload is not None
                           else OptimizerShard(g, init, tile=tile))
        g.bind_params()
        if g.partitioned:
            g.free_full()  # stage 3: only the owned chunk stays
        self.groups.append(g)
        return g

    def _step_batches(self) -> list[tuple[MultiShardStep | None, list[int]]]:
        """The optimizer step's calls, in order: (a multi-tensor step over device-resident shards,
        their group indices), (a HostStepBatch: consecutive host-offloaded shards stepped as one job,
        offload/host_batch.py, at most HOST_BATCH_ELEMS elements) or (None, [i]) for a shard with its
        own step (NVMe, twin-flow, a client torch optimizer's host step, stage 3's queued ones).
        Stages 1/2 over several ranks all-gather each group after its update: there consecutive
        groups are batched up to allgather_bucket_size elements, so one batch's all-gathers run
        while the next batch computes; otherwise every resident shard is in one call."""
        gather = self.policy.shard_optimizer and self.comm.world > 1
        cap = self.config.zero_optimization.allgather_bucket_size
        batches, run, elems = [], [], 0
        # consecutive host shards stepped as one job (offload/host_batch.py)
        elems_cap = speculation.host_batch_elems(self.config, HOST_BATCH_ELEMS)
        host = HostRuns(batches, min(cap, elems_cap) if gather else elems_cap)

        def batch(run):
            if self._torch_step is not None:
                return TorchBatch(self._torch_step, run, self.optimizer.param_groups)
            return MultiShardStep([self.shards[k] for k in run], run)

        for i, (g, shard) in enumerate(zip(self.groups, self.shards)):
            if not shard.batched:  # host / NVMe state: its own step, or a host batch's
                if batchable(shard):
                    host.add(i, shard, g.layout.padded if gather else g.hi - g.lo)
                else:
                    host.close()
                    batches.append((None, [i]))
                continue
            host.close()
            size = g.layout.padded if gather and not g.partitioned else 0
            if gather and run and elems + size > cap:
                batches.append((batch(run), run))
                run, elems = [], 0
            run.append(i)
            elems += size
        host.close()
        if run:
            batches.append((batch(run), run))
        return batches

    def _describe(self, op, index: int) -> str:
        """The name a divergence error gives group ``index``."""
        return self._labels(op, index)

    # -- the training loop (engine(x) is nn.Module.__call__: hooks registered on the engine run) ----
    @reports_stalls
    def forward(self, *args, **kwargs):
        module = self._modules["module"]  # not self.module: nn.Module's __getattr__ path costs microseconds
        if module is None:
            raise EngineDestroyed(DESTROYED)
        states_aside.check_resident(self, "forward")
        if self._bracket is AUTOGRAD:
            torch_backward.close_stale(self)
        self.tput_timer.start()
        try:
            if self._autocast is None:
                out = module(*args, **kwargs)
            else:  # replaces an autocast the caller opened (DeepSpeed's rule)
                with torch.autocast(self._autocast[0], dtype=self._autocast[1]):
                    out = module(*args, **kwargs)
        except RuntimeError as e:
            better = explain_dtype_error(e, args, kwargs, self.dtype, self._upcast)
            if better is None:
                if self.gatherer is not None:
                    note_empty_parameter(e)
                raise
            raise better from e
        if torch.is_grad_enabled() and self._output_hook is not None and (peek_interpreter_stack is None or
                                                                          peek_interpreter_stack() is None):
            # loss.backward() on these outputs opens the engine's backward (under torch.func: a plain function)
            torch_backward.hook_outputs(out, self._output_hook, self._call_before)
        return out

    @reports_stalls
    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagates ``loss`` (divided by the accumulation steps unless ``scale_wrt_gas`` is
        false, times the fp16 loss scale) and reduces gradients; returns the loss divided by the
        accumulation steps (``loss`` itself without ``scale_wrt_gas``), as DeepSpeed does.
        Inside ``no_sync()`` (stages 0/1) gradients accumulate on each rank without a reduction."""
        self._alive()
        if not self.trains:
            trains_nothing.refuse(self, "backward()")
        states_aside.check_resident(self, "backward")
        check_loss(loss)
        if self._bracket is AUTOGRAD:
            torch_backward.close_stale(self)
        div = self.gas if scale_wrt_gas else 1
        self._scale_pending = False  # (an engine.scale(loss) is for a loss.backward(), not for this)
        self._begin_backward(ENGINE)
        factor = self.scaler.scale / div
        try:
            with label("zerocore.backward"), torch_backward.scaled_loss_backward(factor):
                (loss.float() * factor).backward(retain_graph=retain_graph)
        except BaseException:
            self._abort_backward()
            raise
        self._finish_backward()
        return loss / div if scale_wrt_gas else loss

    def _unmanaged_step(self, lr_kwargs: dict | None = None) -> None:
        unmanaged_window.step(self, lr_kwargs)

    @reports_stalls
    @keeps_counters_on_failure
    def step(self, lr_kwargs: dict | None = None) -> None:
        """Ends a micro-batch; at the accumulation boundary updates the parameters and steps the
        lr schedule (with ``lr_kwargs``), except when the update is skipped (fp16 overflow). With
        ``managed_gradient_accumulation: false`` every step() is the boundary (runtime/unmanaged_window.py)."""
        if not self.trains:  # (no call on the hot path: tests/runtime/test_hot_path_counts.py)
            trains_nothing.refuse(self, "step()")
        if self._in_no_sync or self._coalescing:
            coalesced_reduction.refuse_step(self)
            raise NoSyncMisuse("zerocore: step() inside no_sync(); leave the context for the last micro-batch's "
                               "backward (it reduces the accumulated gradients) and call step() after it (DeepSpeed: "
                               "It is illegal to call Engine.step() inside no_sync context manager)")
        states_aside.check_resident(self, "step()")
        if self._bracket is AUTOGRAD:
            torch_backward.close_stale(self)
        self._requires_grad.check()  # before anything changes: fix it and call step() again
        if self._zc_state_lost is not None:
            from .checkpoint_marks import check_state_whole

            check_state_whole(self, "step()")
        boundary = self.is_gradient_accumulation_boundary()
        if self.reducer.window_lost and boundary:
            raise RuntimeError(f"zerocore: {self.reducer.window_lost} (gradient accumulation): this "
                               "window's gradients cannot be restored; call engine.zero_grad() to drop the window's "
                               "gradients (nothing was updated)")
        if not self._backward_done:
            raise RuntimeError("zerocore: step() without backward(); call engine.backward(loss) (or loss.backward() "
                               "on a loss computed from engine(...)'s outputs) first"
                               + (" (zero_grad() after the last backward() discarded its gradients: step() clears "
                                  "them itself, call zero_grad() only before a backward)" if self._dropped else ""))
        if not self.config.managed_gradient_accumulation:
            unmanaged_window.finish_window(self)  # the caller's window ends here (stages 0/1 reduce now)
        self._backward_done = False
        self.micro_steps += 1
        self.tput_timer.stop(global_step=boundary)
        if not boundary:
            return
        self.__dict__["_boundary_step"] = self.micro_steps  # (was_step_applied; no Module.__setattr__ call)
        self.global_steps += 1
        self._count_samples()
        for _, p in self._ungrouped:  # in no hyper-parameter group: never updated, gradients not kept
            p.grad = None
        if self.gatherer is not None:
            self.gatherer.free_all()  # no full buffer may outlive the update of its chunk
        self.guard.check(Op.STEP, 0)
        grads = owned_grads(self.groups)
        scaled = boundary_coef(self, grads)  # the norm, the clip and the Inf/NaN decision (update_coef.py)
        if scaled is None:  # skipped
            return
        coef, pending = scaled
        hypers = self.optimizer.hypers()  # the groups' values now (edits and schedules take effect here)
        self._optimizer_steps += 1  # (settled at the start of step(): keeps_counters_on_failure reads it)
        if self._zc_pending_save is not None:  # an asynchronous save may still be copying the state
            self._zc_pending_save.snapshot_taken()
        with label("zerocore.optimizer_step"):
            self._update(coef, grads, hypers)
            if self.offload is not None:
                # The host Adam steps: each offloaded shard's step above ran it, or (stage 3) queued it;
                # the queued ones go to the worker thread now, first-needed first (offload/placement.py),
                # and each unit's next gather waits for its own (ShardedGroup.owned_params).
                self.offload.launch()
        self.scaler.update(False)
        self.reducer.clear()
        self._overflow = False
        self._pending_skip = pending
        sched = self.lr_scheduler
        if sched is not None:
            if pending is not None and not pending.keep_schedule(sched, self.optimizer):
                self._settle_skip()  # a schedule whose step cannot be taken back: the decision is read now
                if self._overflow:
                    return
            opt = getattr(sched, "optimizer", None)  # the face, or the client optimizer it shares groups with
            if opt is not None:
                opt._opt_called = True  # what torch's LRScheduler checks optimizer.step() set
            sched.step(**(lr_kwargs or {}))
            if pending is not None:
                pending.schedule_stepped()

    def _update(self, coef: float | torch.Tensor, grads: list[torch.Tensor], hypers: list[AdamHyper]) -> None:
        """``grads[i]``: group i's owned gradient; ``hypers[h]``: hyper-parameter group h's values."""
        gather = self.policy.shard_optimizer and self.comm.world > 1
        cap = self.config.zero_optimization.allgather_bucket_size
        inflight, elems = [], 0
        if self._torch_step is not None:
            self._torch_step.sync(self.optimizer.param_groups)
        for multi, index in self._batches:
            if multi is not None:
                multi.step(grads, hypers, step=self._optimizer_steps, grad_scale=coef)
            else:
                self.shards[index[0]].step(grads[index[0]], hypers, step=self._optimizer_steps, grad_scale=coef)
            if not gather:
                continue
            for i in index:
                g = self.groups[i]
                if g.partitioned:  # stage 3 units: the next forward gathers the new chunks
                    continue
                g.param_state.to(ParamState.SHARDED)
                # This batch's all-gathers run while the next batch's Adam step computes; at
                # most allgather_bucket_size elements are in flight.
                while inflight and elems + g.layout.padded > cap:
                    h, done = inflight.pop(0)
                    h.wait()
                    done.param_state.to(ParamState.GATHERED)
                    elems -= done.layout.padded
                g.param_state.to(ParamState.GATHERING)
                inflight.append((self.comm.all_gather(g.param_flat, async_op=True), g))
                elems += g.layout.padded
        for h, done in inflight:
            h.wait()
            done.param_state.to(ParamState.GATHERED)

    def _skip(self) -> None:
        self.skipped_steps += 1
        self.overflow = True
        self.global_grad_norm = math.inf
        if self.scaler.dynamic:
            self.scaler.update(True)  # lowers the scale; warns (and goes on) at the minimum
        else:
            warnings.warn(f"zerocore: Inf/NaN in the gradients at step {self.global_steps}; the update was skipped",
                          RuntimeWarning, stacklevel=3)
        self.reducer.clear()

    def skip_on_overflow(self, on: bool) -> None:
        """Whether a boundary whose gradients hold Inf/NaN skips its update (fp16 always; bf16 with
        ``check_grad_overflow``; ``zerocore.deepspeed`` engines as DeepSpeed decides: deepspeed/semantics.py).
        Without fp16 the decision is made on the device and read a step later (runtime/deferred_skip.py)
        where every update reads the device coefficient (zerocore's Adam, no offload, whose norms are host
        values and which skips such a step always); else read once per boundary."""
        self._checks_overflow = bool(on)
        self._defers_skip = (self._checks_overflow and not self.config.fp16.enabled and self.offload is None
                             and self._torch_step is None)

    def _settle_skip(self) -> None:
        """Reads the last deferred Inf/NaN decision, if one is pending (runtime/deferred_skip.settle)."""
        settle(self)

    # The counts a deferred Inf/NaN decision may still change: read or set, they settle it first.
    optimizer_steps = SettledCount("Updates applied (Adam's step count).")
    skipped_steps = SettledCount("Accumulation boundaries whose update was skipped (Inf/NaN gradients, fp16 overflow).")
    overflow = SettledCount("Whether the last accumulation boundary skipped its update.")

    def zero_grad(self) -> None:
        """Discards the gradients accumulated so far (step() already does this after updating)."""
        if self._bracket is AUTOGRAD:
            torch_backward.close_stale(self)
        self.reducer.clear()
        for _, p in self._ungrouped:
            p.grad = None
        self._dropped = self._backward_done  # between backward and step: that micro-batch is gone
        self._backward_done = False

    # -- facts -----------------------------------------------------------------------------
    @property
    def global_grad_norm(self) -> float | None:
        """The global gradient norm of the last boundary, before clipping (inf when it skipped or a
        gradient held Inf/NaN; None before the first). bf16/fp32 keep it on the device: it is read
        here, when asked (the only host wait it costs), not by the step."""
        norm = self.__dict__.get("_grad_norm")
        if isinstance(norm, torch.Tensor):
            norm = self.__dict__["_grad_norm"] = norm.item()
        return norm

    @global_grad_norm.setter
    def global_grad_norm(self, value) -> None:
        self.__dict__["_grad_norm"] = value

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def lr(self) -> float:
        """The first group's learning rate; setting it sets every group's."""
        self._settle_skip()  # a skipped update's schedule step is taken back first
        return float(self.optimizer.param_groups[0]["lr"])

    @lr.setter
    def lr(self, value: float) -> None:
        value = checked_lr(value)
        self._settle_skip()  # else taking a skipped step back would restore the old value over this one
        for g in self.optimizer.param_groups:
            g["lr"] = value

    def get_lr(self) -> list[float]:
        """Every hyper-parameter group's learning rate (DeepSpeed's ``get_lr``)."""
        self._settle_skip()
        return [g["lr"] for g in self.optimizer.param_groups]

    @property
    def hyper(self) -> AdamHyper:
        """The first group's hyper-parameters as the next update reads them."""
        return self.optimizer.hypers()[0]

    @property
    def world_size(self) -> int:
        return self.comm.world

    @property
    def rank(self) -> int:
        return self.comm.rank

    def destroy(self, collective: bool = True, partitioned: bool = False) -> None:
        """Gives the model back: hooks removed, every parameter its own tensor with its full current
        value (stage 3 gathers: a collective; ``collective=False`` skips that and leaves stage-3
        parameters empty). ``partitioned=True``: stage 3's partitioned parameters stay partitioned,
        as ``zerocore.init`` leaves them, for the next ``zerocore.initialize`` to adopt (no rank
        holds the whole model; ``runtime/release.py``). Then stops the engine's workers, closes its
        NVMe swap stores and, once no engine is left, destroys the process groups zerocore created
        (the default group only if zerocore initialized it). The engine cannot be used afterwards."""
        if self.module is None:
            return
        self._settle_skip()  # the counts a destroyed engine keeps are the true ones
        try:
            release(self, collective, partitioned)
        finally:
            self.module = None
            try:
                close_engine(self, collective)
            finally:
                forget_state(self)  # every buffer goes now, even if the engine object stays referenced

    def offload_states(self, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False) -> None:
        """Moves the training state off the device into (page-locked) host memory, its device memory
        back to the caching allocator, until ``reload_states()`` (DeepSpeed's method: ``include`` takes
        ``OffloadStateTypeEnum`` names; see ``runtime/offload_states.py`` for what moves)."""
        self._alive()
        states_aside.offload_states(self, include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Brings back what ``offload_states()`` moved, bit for bit."""
        self._alive()
        states_aside.reload_states(self, non_blocking)

    def _alive(self) -> None:
        # _modules, not self.module (nn.Module's __getattr__ path); destroyed, _modules is gone too
        if self._modules["module"] is None:
            raise EngineDestroyed(DESTROYED)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.destroy(collective=exc_type is None)  # after an error the other ranks may not be there

    def memory_report(self, predicted: bool = False, *, micro_batch: int | None = None, seq_len: int | None = None,
                      meta_model=None) -> dict:
        """Model-state bytes this rank holds, by role, counted from its tensors. ``predicted``: with the
        planner's figures beside them (``zerocore.estimate``; see ``runtime/memory.py``)."""
        return with_prediction(self, held_bytes(self), micro_batch, seq_len, meta_model) if predicted else held_bytes(self)

    # -- weights out -----------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict with full fp32 weights on CPU, under the model's own names (every
        name of a tied weight), on every rank. A collective: call it on all ranks."""
        states_aside.check_resident(self, "full_state_dict()")
        return weights.full_state_dict(self, torch.float32)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's ``save_16bit_model``: rank 0 writes the full weights in the training dtype
        (atomically); at stage 3 only with ``stage3_gather_16bit_weights_on_model_save``. A
        collective: call it on all ranks. Returns whether a file was written (on rank 0)."""
        return weights.save_16bit_model(self, save_dir, save_filename)

