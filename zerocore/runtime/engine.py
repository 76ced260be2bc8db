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
from ..profiling import label
from ..comm import Comm
from ..config import ZeroConfig, require_implemented
from ..comm.divergence import DivergenceGuard, Op
from ..sharding import (AdamHyper, GradReducer, OptimizerShard, ParamState, ShardedGroup,
                        policy_for)
from ..sharding.gatherer import Limits, ParamGatherer
from .loss_scale import LossScaler
from .memory import held_bytes
from .grad_norm import grad_sumsq, reduce_dtype
from .model_setup import convert_rest, named_params, training_dtype
from .gathered import register_engine
from .partition_init import check_unchanged, initial_value
from .group_specs import GroupSpec, size_groups, stage3_groups
from . import weights


class Engine:
    def __init__(self, module: torch.nn.Module, config: ZeroConfig, comm: Comm):
        require_implemented(config)
        self.module = module
        self.config = config
        self.comm = comm
        z = config.zero_optimization
        self.policy = policy_for(z.stage)
        self.dtype = training_dtype(config)
        self.gas, _, _ = config.batch_sizes(comm.world)
        trainable, frozen = named_params(module)
        if not trainable:
            raise ValueError("zerocore: the model has no trainable parameters")
        self.device = trainable[0][1].device
        for names, p in trainable + frozen:
            check_unchanged(p, names[0])
        self.groups: list[ShardedGroup] = []
        self.shards: list[OptimizerShard] = []
        self.gatherer: ParamGatherer | None = None
        units = []
        for spec in self._group_specs(module, trainable, z):
            g = self._add_group(spec.layout, spec.params, spec.policy)
            if spec.unit is not None:
                units.append((spec.unit[0], spec.unit[1], g))
        convert_rest(module, frozen, self.dtype, comm)
        # which group and slot hold each parameter (zerocore.gathered finds them here)
        self.param_index = {id(p): (g.index, i) for g in self.groups for i, p in enumerate(g.params)}
        register_engine(self)
        # Stage 3: every collective is checked first against the other ranks' (divergence).
        self.guard = DivergenceGuard(comm, self._describe, enabled=z.stage == 3 and z.stage3_check_divergence,
                                     timeout_s=z.stage3_divergence_timeout)
        if z.stage == 3:
            self.gatherer = ParamGatherer(module, units, comm, self.guard, Limits(
                prefetch_elems=z.stage3_prefetch_bucket_size, max_live=z.stage3_max_live_parameters,
                max_reuse=z.stage3_max_reuse_distance))
        self.reducer = GradReducer(self.groups, comm, overlap=z.overlap, reduce_scatter=z.reduce_scatter,
                                   device=self.device, guard=self.guard if self.guard.enabled else None,
                                   on_complete=self.gatherer.on_group_complete if self.gatherer else None,
                                   reduce_dtype=reduce_dtype(z.reduce_dtype, self.dtype))
        self.scaler = LossScaler(config.fp16 if config.fp16.enabled else None)
        p = config.optimizer.params
        self.hyper = AdamHyper(lr=p.lr, betas=tuple(p.betas), eps=p.eps, weight_decay=p.weight_decay,
                               decoupled=config.optimizer.decoupled)
        self.micro_steps = 0
        self.global_steps = 0  # accumulation boundaries reached (including skipped updates)
        self.optimizer_steps = 0  # updates applied (Adam's step count)
        self.skipped_steps = 0
        self.global_grad_norm: float | None = None
        self._backward_done = False

    def _group_specs(self, module, trainable, z) -> list[GroupSpec]:
        if z.stage == 3:
            return stage3_groups(module, trainable, z, self.comm.world, self.dtype)
        # Groups in reverse registration order: close to the order backward produces gradients,
        # so buckets fill (and launch) one after another.
        return size_groups(list(reversed(trainable)), z.reduce_bucket_size, self.comm.world, self.dtype, self.policy)

    def _add_group(self, layout, params, policy) -> ShardedGroup:
        # The initial values, in fp32, broadcast from rank 0 so every rank starts identical;
        # the fp32 master is cut from them before the parameters are rounded to 16 bits.
        init = torch.zeros(layout.padded, dtype=torch.float32, device=self.device)
        for slot, p in zip(layout.slots, params):
            init[slot.offset:slot.end] = initial_value(p, self.comm)
        self.comm.broadcast(init)
        if self.dtype == torch.float32:
            flat = init
        else:
            flat = ops.cast(init, torch.empty(layout.padded, dtype=self.dtype, device=self.device))
        g = ShardedGroup(layout, params, policy, self.comm.rank, self.device, param_flat=flat)
        tile = self.config.zero_optimization.sub_group_size if self.config.zero_optimization.stage == 3 else None
        self.shards.append(OptimizerShard(g, init, tile=tile))
        g.bind_params()
        if g.partitioned:
            g.free_full()  # stage 3: only the owned chunk stays
        self.groups.append(g)
        return g

    def _describe(self, op, index: int) -> str:
        """The name a divergence error gives group ``index``."""
        if self.gatherer is not None and index in self.gatherer.by_group:
            return self.gatherer.by_group[index].label
        if 0 <= index < len(self.groups):
            g = self.groups[index]
            return f"group {index} (persistent parameters '{g.layout.slots[0].name}'...)"
        return f"group {index}"

    # -- the training loop ---------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backpropagates ``loss`` (divided by the accumulation steps, times the fp16 loss scale)
        and reduces gradients; returns ``loss``."""
        if self._backward_done:
            raise RuntimeError("zerocore: backward() called twice without step(); call engine.step() after "
                               "every micro-batch's backward (it only updates at the accumulation boundary)")
        boundary = (self.micro_steps + 1) % self.gas == 0
        if self.gatherer is not None:
            self.gatherer.begin_backward()
        self.reducer.begin_backward(boundary)
        try:
            with label("zerocore.backward"):
                (loss.float() * (self.scaler.scale / self.gas)).backward()
            self.reducer.finish_backward()
        except BaseException:
            self.reducer.abort()
            if self.gatherer is not None:
                self.gatherer.free_all()
            raise
        if self.gatherer is not None:
            self.gatherer.end_backward()
        self._backward_done = True
        return loss

    def step(self) -> None:
        """Ends a micro-batch; at the accumulation boundary updates the parameters."""
        if not self._backward_done:
            raise RuntimeError("zerocore: step() without backward(); call engine.backward(loss) first")
        self._backward_done = False
        self.micro_steps += 1
        if self.micro_steps % self.gas:
            return
        self.global_steps += 1
        if self.gatherer is not None:
            self.gatherer.free_all()  # no full buffer may outlive the update of its chunk
        self.guard.check(Op.STEP, 0)
        # The reduced gradients are sums over ranks of loss-scaled gradients.
        denom = self.comm.world * self.scaler.scale
        with label("zerocore.grad_norm"):
            sumsq, bad = grad_sumsq([g.owned_grad() for g in self.groups], self.comm,
                                    across_ranks=self.policy.partitions(self.comm.world) > 1)
        if bad or not math.isfinite(sumsq):
            self._skip()
            return
        norm = math.sqrt(sumsq) / denom
        self.global_grad_norm = norm
        coef = 1.0 / denom
        clip = self.config.gradient_clipping
        if clip > 0:
            coef *= min(1.0, clip / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s coefficient
        self.optimizer_steps += 1
        with label("zerocore.optimizer_step"):
            self._update(coef)
        self.scaler.update(False)
        self.reducer.clear()

    def _update(self, coef: float) -> None:
        gather = self.policy.shard_optimizer and self.comm.world > 1
        cap = self.config.zero_optimization.allgather_bucket_size
        inflight, elems = [], 0
        for g, shard in zip(self.groups, self.shards):
            shard.step(g.owned_grad(), self.hyper, step=self.optimizer_steps, grad_scale=coef)
            if not gather or g.partitioned:  # stage 3 units: the next forward gathers the new chunks
                continue
            g.param_state.to(ParamState.SHARDED)
            # The all-gather of this group runs while the next group's Adam step computes;
            # at most allgather_bucket_size elements are in flight.
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
        self.global_grad_norm = math.inf
        if self.scaler.dynamic:
            self.scaler.update(True)  # lowers the scale; warns (and goes on) at the minimum
        else:
            warnings.warn(f"zerocore: Inf/NaN in the gradients at step {self.global_steps}; the update was skipped",
                          RuntimeWarning, stacklevel=3)
        self.reducer.clear()

    def zero_grad(self) -> None:
        """Discards the gradients accumulated so far (step() already does this after updating)."""
        self.reducer.clear()

    # -- facts -----------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def lr(self) -> float:
        return self.hyper.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.hyper.lr = float(value)

    @property
    def world_size(self) -> int:
        return self.comm.world

    @property
    def rank(self) -> int:
        return self.comm.rank

    def memory_report(self) -> dict[str, int]:
        """Model-state bytes this rank holds, by role, counted from its tensors."""
        return held_bytes(self)

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    # -- weights out -----------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict with full fp32 weights on CPU, under the model's own names (every
        name of a tied weight), on every rank. A collective: call it on all ranks."""
        return weights.full_state_dict(self, torch.float32)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's ``save_16bit_model``: rank 0 writes the full weights in the training dtype
        (atomically); at stage 3 only with ``stage3_gather_16bit_weights_on_model_save``. A
        collective: call it on all ranks. Returns whether a file was written (on rank 0)."""
        return weights.save_16bit_model(self, save_dir, save_filename)
