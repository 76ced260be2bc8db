"""``engine.optimizer``: a ``torch.optim.Optimizer`` whose ``param_groups`` are the engine's
hyper-parameter groups, so schedules, trainers and scripts read and edit them as with torch.

The engine reads every group's lr, betas, eps and weight decay at each update (an edit of
``param_groups[i]["lr"]`` takes effect at the next step); the state lives in the engine's
sharded optimizer shards, so ``step()`` and ``zero_grad()`` here do nothing (the engine steps
and clears at each accumulation boundary, as DeepSpeed's engine does). With a client optimizer
the face shares that optimizer's ``param_groups`` list: a scheduler built over the client
optimizer drives the engine too. ``state_dict()`` holds the groups' hyper-parameters (the
sharded state is saved by ``engine.save_checkpoint``).
"""
from __future__ import annotations

import math

import torch

from .._weak import GONE, back_ref
from ..sharding import ALIGN_ELEMS, AdamHyper
from .scaler_views import LossScaleConfigView, ScalerView, set_scale


class ZeroOptimizer(torch.optim.Optimizer):
    # the engine owns this face (and trainers hold it too): a weak reference back, or the engine would
    # be in a cycle and outlive every user reference to it until the cyclic collector runs
    _engine = back_ref()

    def __init__(self, engine, groups: list[dict], defaults: dict, *, decoupled: bool, shared: list | None = None):
        """``groups``: resolved param groups (every key present); ``shared``: a client optimizer's
        ``param_groups`` list to use as this face's own (same dict objects)."""
        super().__init__(groups if shared is None else shared, defaults)
        if shared is not None:
            self.param_groups = shared
        self._engine = engine
        self._decoupled = decoupled
        self._hypers = [self._hyper_of(g, i) for i, g in enumerate(self.param_groups)]

    def _hyper_of(self, g: dict, i: int) -> AdamHyper:
        hp = AdamHyper(lr=0.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=self._decoupled)
        self._read(g, hp, i)
        return hp

    def _read(self, g: dict, hp: AdamHyper, i: int) -> None:
        lr = g["lr"]
        if type(lr) is not float:  # a tensor (some schedules), an int
            lr = float(lr.item() if isinstance(lr, torch.Tensor) else lr)
        if not math.isfinite(lr) or lr < 0:
            raise ValueError(f"zerocore: optimizer.param_groups[{i}]['lr'] is {lr!r}; it must be a finite number >= 0 "
                             "(nothing was updated)")
        hp.lr = lr
        b = g.get("betas")
        if b is not None:
            hp.betas = (float(b[0]), float(b[1]))
        hp.eps = float(g.get("eps", hp.eps))
        hp.weight_decay = float(g.get("weight_decay", hp.weight_decay))
        hp.decoupled = bool(g.get("decoupled_weight_decay", self._decoupled))

    def hypers(self) -> list[AdamHyper]:
        """Every group's hyper-parameters as they are now (read at each update)."""
        groups, hypers = self.param_groups, self._hypers
        if len(groups) != len(hypers):
            raise RuntimeError(f"zerocore: optimizer.param_groups has {len(groups)} groups, the engine was built with "
                               f"{len(hypers)}; groups cannot be added or removed after initialize")
        for i, (g, hp) in enumerate(zip(groups, hypers)):
            self._read(g, hp, i)
        return hypers

    # -- torch.optim.Optimizer's face ------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """A no-op: the engine updates at ``engine.step()`` on the accumulation boundary."""
        if closure is not None:
            with torch.enable_grad():
                return closure()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """A no-op: the engine clears gradients after each update (``engine.zero_grad()`` drops a window)."""

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_engine", None) is not None:
            raise RuntimeError("zerocore: optimizer.add_param_group after initialize: the engine's flat buffers are "
                               "built from the groups given to initialize (pass every group as model_parameters)")
        super().add_param_group(param_group)

    @property
    def optimizer(self):
        """DeepSpeed's ``engine.optimizer.optimizer`` (the basic optimizer its wrapper steps): the
        optimizer passed to initialize, which shares these param_groups; without one, at stage 0
        without fp16/bf16 (where DeepSpeed has no wrapper) this face, else a view of this rank's
        Adam state over the flat fp32 master pieces (``shard_view.py``), as DeepSpeed's basic
        optimizer holds the flat partitions."""
        engine = self._live()
        if engine.client_optimizer is not None:
            return engine.client_optimizer
        if engine.zero_optimization_stage() == 0 and engine.dtype == torch.float32:
            return self
        view = engine.__dict__.get("_zc_shard_view")  # made once: its tensors are keys of its state
        if view is None:
            from .shard_view import ShardAdamView

            view = engine._zc_shard_view = ShardAdamView(engine)
        return view

    def _stage12(self, name: str):
        engine = self._live()
        if engine.zero_optimization_stage() not in (1, 2):
            raise AttributeError(f"'ZeroOptimizer' has {name} at ZeRO stages 1 and 2 only (DeepSpeed's stage 1-2 "
                                 "optimizer's partitions)")
        return engine

    @property
    def nccl_start_alignment_factor(self) -> int:
        """DeepSpeed's stage 1-2 attribute: each rank's partition of a flat 16-bit group starts at a
        multiple of this many elements. zerocore pads every flat group to ``world * ALIGN_ELEMS``
        (32) elements and splits it equally, so its partitions start at multiples of 32 (DeepSpeed's
        at multiples of 2, 4 bytes of fp16)."""
        self._stage12("nccl_start_alignment_factor")
        return ALIGN_ELEMS

    @property
    def parallel_partitioned_bit16_groups(self) -> list[list[torch.Tensor]]:
        """DeepSpeed's stage 1-2 attribute: for each flat group of the training-dtype parameters (a
        zerocore bucket; DeepSpeed has one per param group), every rank's partition of it, views of
        the flat buffer each rank holds whole (writing them writes the parameters)."""
        engine = self._stage12("parallel_partitioned_bit16_groups")
        world = engine.comm.world
        return [[g.param_flat[a:b] for a, b in (g.layout.range_of(r, world) for r in range(world))]
                for g in engine.groups]

    def _stage3_subgroups(self, name: str):
        """(engine group index, hyper group, fp32 master piece) of DeepSpeed's stage-3 sub-groups:
        each piece of this rank's fp32 master holding one hyper group of one engine group (a stage-3
        unit), the tensors ``optimizer.optimizer`` (the state view) steps. Only at stage 3 without a
        client optimizer (DeepSpeed's stage 1-2 optimizer has no such attributes): AttributeError
        otherwise."""
        engine = self._live()
        if engine.zero_optimization_stage() != 3 or engine.client_optimizer is not None:
            raise AttributeError(f"'ZeroOptimizer' has {name} at ZeRO stage 3 without a client optimizer only "
                                 "(DeepSpeed's stage-3 optimizer's sub-groups)")
        return self.optimizer.subgroups

    def _stage3_only(self, name: str) -> None:
        if self._live().zero_optimization_stage() != 3:
            raise AttributeError(f"'ZeroOptimizer' has {name} at ZeRO stage 3 only (DeepSpeed's stage-3 optimizer's)")

    @property
    def _set_fp32_optimizer_param_groups(self):
        """DeepSpeed's stage-3 call before reading ``optimizer.optimizer.state_dict()`` (its basic optimizer's
        groups are emptied between steps): here ``optimizer.optimizer`` (the state view, or the client optimizer)
        always holds what it steps, so the call has nothing to put back. An attribute at stage 3 only (``hasattr``
        tells the stage, as with DeepSpeed)."""
        self._stage3_only("_set_fp32_optimizer_param_groups")
        return _nothing

    @property
    def _clear_fp32_optimizer_param_groups(self):
        """DeepSpeed's stage-3 counterpart of ``_set_fp32_optimizer_param_groups``: nothing to take out here."""
        self._stage3_only("_clear_fp32_optimizer_param_groups")
        return _nothing

    @property
    def fp32_partitioned_groups_flat(self) -> list[torch.Tensor]:
        """DeepSpeed's stage-3 attribute: this rank's flat fp32 master partition of each sub-group,
        the keys of ``optimizer.optimizer.state`` (views of the engine's own master: writing them
        writes the master)."""
        return [m for _, _, m in self._stage3_subgroups("fp32_partitioned_groups_flat")]

    @property
    def fp16_groups(self) -> list[list[torch.nn.Parameter]]:
        """DeepSpeed's stage-3 attribute: the model's parameters of each sub-group (whole
        parameters, whichever rank holds their values), matching ``fp32_partitioned_groups_flat``.
        A sub-group is the parameters of one hyper group in one stage-3 unit; a unit of several
        hyper groups where this rank holds none of one has no sub-group for it here."""
        engine = self._engine
        subgroups = self._stage3_subgroups("fp16_groups")
        out = []
        for k, h, _ in subgroups:
            mine = {id(p) for p in self.param_groups[h]["params"]}
            out.append([p for p in engine.groups[k].params if id(p) in mine])
        return out

    @property
    def leaf_parameters(self) -> dict:
        """DeepSpeed's stage-3 attribute: each ZeRO-3 leaf module (``set_z3_leaf_modules``, or the config's
        ``zero_optimization.leaf_module``; the outermost where leaves nest) and its trainable parameters,
        gathered and freed with the module as a whole (sharding/leaf_modules.py)."""
        from ..sharding.leaf_modules import leaf_ids

        engine = self._live()
        if engine.zero_optimization_stage() != 3:
            raise AttributeError("'ZeroOptimizer' has leaf_parameters at ZeRO stage 3 only (DeepSpeed's stage-3 "
                                 "optimizer's)")
        model = engine.module
        leaves = leaf_ids(model, engine.config.zero_optimization.leaf_module)
        out, inside = {}, set()
        for m in model.modules():  # parents before children: a leaf inside a leaf is the outer one's
            if id(m) in inside:
                inside.update(id(c) for c in m.children())
                continue
            if id(m) in leaves:
                params = [p for p in m.parameters() if p.requires_grad]
                if params:
                    out[m] = params
                inside.update(id(c) for c in m.children())
        return out

    @property
    def overflow(self) -> bool:
        """Whether the last accumulation boundary skipped its update (fp16 overflow, Inf/NaN)."""
        return self._live().overflow

    @property
    def dynamic_loss_scale(self) -> bool:
        """DeepSpeed's: whether fp16's loss scale is dynamic (``fp16.loss_scale`` 0)."""
        return self._scaler().dynamic

    @property
    def cur_scale(self) -> float:
        """DeepSpeed's: the loss scale the next backward uses (1 without fp16); may be set with fp16 (a positive
        finite number), as DeepSpeed's optimizers let it be."""
        return self._scaler().scale

    @cur_scale.setter
    def cur_scale(self, value) -> None:
        set_scale(self._scaler(), value)

    loss_scale = cur_scale  # the name every DeepSpeed fp16 optimizer has, stage 0 included

    @property
    def loss_scaler(self) -> ScalerView:
        """DeepSpeed's ZeRO optimizers' loss scaler object, read when asked (runtime/scaler_views.py)."""
        return ScalerView(self._scaler)

    @property
    def loss_scale_config(self) -> LossScaleConfigView:
        """DeepSpeed's stage-0 fp16 optimizers' ``LossScaleConfig``, read when asked (runtime/scaler_views.py)."""
        return LossScaleConfigView(self._scaler, self._boundaries)

    def _live(self):
        """The engine this face belongs to, or the error naming a destroyed one."""
        engine = self._engine
        if engine is None:
            raise RuntimeError(GONE)
        return engine

    def _scaler(self):
        return self._live().scaler

    def _boundaries(self) -> int:
        return self._live().global_steps

    def needs_scaler(self) -> bool:
        """DeepSpeed's: whether a ``loss.backward()`` needs ``engine.scale(loss)`` first (fp16 with a loss
        scale other than 1; never bf16/fp32)."""
        return self._scaler().needed

    def __repr__(self) -> str:
        lrs = ", ".join(f"{g['lr']:g}" if isinstance(g["lr"], float) else str(g["lr"]) for g in self.param_groups)
        return f"ZeroOptimizer({len(self.param_groups)} groups, lr [{lrs}])"


def _nothing() -> None:
    """What ``_set/_clear_fp32_optimizer_param_groups`` do here."""
