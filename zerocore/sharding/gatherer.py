"""Stage 3 at run time: gather a unit's parameters when its module runs, free them after.

Forward: a unit's pre-forward hook gathers its group (waiting for a prefetch already in
flight), the module runs, its post-forward hook frees the full buffer and registers a
pre-backward hook on the outputs. Backward: that hook re-gathers the unit just before its
backward runs; the unit is freed as soon as the last of its parameters' gradients has been
packed into a bucket (the reducer tells us), so at most the units whose backward is under way
are resident.

Prefetch: the order units ran in is recorded (the first forward and the first backward); while
unit k computes, the next units of the recorded order are gathered asynchronously, up to
``stage3_prefetch_bucket_size`` elements ahead and ``stage3_max_live_parameters`` elements
resident. When a pass departs from the recorded order (a module skipped, a different branch),
prefetching stops for the rest of that pass and everything is gathered on demand; the new order
is recorded at the end of the pass. Every rank decides identically from its own recording, and
the divergence guard checks before each collective that they really agree.

Reuse: with ``stage3_max_reuse_distance`` > 0 a unit is kept gathered after its forward when
its next use (a second call, or its backward right after the forward ends) comes within that
many gathered elements, while resident elements stay within ``stage3_max_live_parameters``.

Activation checkpointing: a forward re-run inside backward gathers its unit (if needed) and
leaves it gathered for the backward that follows.

A module may read another unit's parameter (``self.other.weight``, parameters shared outside
the module tree): modules owning partitioned parameters get a ``__getattr__`` that gathers the
owning unit on first access during forward or backward, frees it with the module that used it,
and re-gathers it before that module's backward.
"""
from __future__ import annotations

import dataclasses
import enum

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from ..comm import Comm
from ..comm.divergence import DivergenceGuard, Op, Phase
from .group import ShardedGroup
from .state import ParamState


class Running(enum.Enum):
    """Which pass the gatherer is in (the divergence headers say it with ``Phase``)."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclasses.dataclass(eq=False)
class Unit:
    pos: int  # index in ParamGatherer.units
    name: str  # module path ("" = the root)
    module: nn.Module
    group: ShardedGroup | None  # None: the root when all its parameters are in other units
    handle: object = None  # the in-flight all-gather
    extern: set = dataclasses.field(default_factory=set)  # units whose params this unit's forward read

    @property
    def numel(self) -> int:
        return self.group.layout.padded if self.group is not None else 0

    @property
    def state(self) -> ParamState:
        return self.group.param_state.value if self.group is not None else ParamState.GATHERED

    @property
    def label(self) -> str:
        return f"unit '{self.name or '<root>'}'"


@dataclasses.dataclass
class Limits:
    prefetch_elems: int  # stage3_prefetch_bucket_size
    max_live: int  # stage3_max_live_parameters
    max_reuse: int  # stage3_max_reuse_distance


class _Pass:
    """The order units run in during one forward or one backward pass, against the recorded one."""

    def __init__(self, recorded: list[int] | None):
        self.recorded = recorded
        self.order: list[int] = []
        self.on_trace = recorded is not None

    def visit(self, pos: int) -> int:
        i = len(self.order)
        self.order.append(pos)
        if self.on_trace and (i >= len(self.recorded) or self.recorded[i] != pos):
            self.on_trace = False
        return i

    def ahead(self, i: int) -> list[int]:
        return self.recorded[i + 1:] if self.on_trace else []

    def final(self) -> list[int] | None:
        """The order to record for the next pass (None: keep what was recorded)."""
        if self.recorded is None or not self.on_trace or len(self.order) != len(self.recorded):
            return list(self.order)
        return None


class ParamGatherer:
    def __init__(self, root: nn.Module, units: list[tuple[str, nn.Module, ShardedGroup]], comm: Comm,
                 guard: DivergenceGuard, limits: Limits):
        """``units``: (module path, module, its group). The root module is always hooked (it frames
        each forward pass), with an empty unit if all its parameters went to other units."""
        if not any(m is root for _, m, _ in units):
            units = [("", root, None)] + list(units)
        self.root = root
        self.units = [Unit(i, name, m, g) for i, (name, m, g) in enumerate(units)]
        self.comm = comm
        self.guard = guard
        self.limits = limits
        self.by_group = {u.group.index: u for u in self.units if u.group is not None}
        self.unit_of_param = {id(p): u for u in self.units if u.group is not None for p in u.group.params}
        self.running = Running.IDLE
        self.stack: list[Unit] = []  # units whose forward is running, innermost last
        self.fwd_trace: list[int] | None = None
        self.bwd_trace: list[int] | None = None
        self.fwd: _Pass | None = None
        self.bwd: _Pass | None = None
        self.live = 0  # elements gathered or being gathered
        self.peak_live = 0
        self._hooks = []
        for u in self.units:
            self._hooks.append(u.module.register_forward_pre_hook(self._hook_pre_forward(u)))
            self._hooks.append(u.module.register_forward_hook(self._hook_post_forward(u), always_call=True))
        self._swap_getattr()

    # -- gather / free -------------------------------------------------------------------
    def _gather(self, u: Unit, phase: int, wait: bool = True) -> None:
        state = u.state
        if state is ParamState.GATHERING:
            if wait:
                self._wait(u)
            return
        if state is ParamState.GATHERED:
            return
        self.guard.check(Op.GATHER, u.group.index, phase)
        u.handle = u.group.start_gather(self.comm, async_op=True)
        self.live += u.numel
        self.peak_live = max(self.peak_live, self.live)
        if wait:
            self._wait(u)

    def _wait(self, u: Unit) -> None:
        u.handle.wait()
        u.handle = None
        u.group.finish_gather()

    def _free(self, u: Unit) -> None:
        state = u.state
        if u.group is None or state is ParamState.SHARDED:
            return
        if state is ParamState.GATHERING:
            self._wait(u)
        u.group.free_full()
        self.live -= u.numel

    def free_all(self) -> None:
        """Every unit back to its owned chunk (before the optimizer step changes the chunks)."""
        for u in self.units:
            self._free(u)
        self.stack.clear()
        self.running = Running.IDLE

    def _prefetch(self, ahead: list[int], phase: int) -> None:
        budget = self.limits.prefetch_elems
        for pos in ahead:
            v = self.units[pos]
            budget -= v.numel
            if budget < 0:
                return
            if v.state is not ParamState.SHARDED:
                continue
            if self.live + v.numel > self.limits.max_live:
                return
            self._gather(v, phase, wait=False)

    # -- forward -------------------------------------------------------------------------
    def _hook_pre_forward(self, u: Unit):
        def hook(module, args):
            if self.running is Running.BACKWARD:  # activation checkpointing recomputes inside backward:
                self.stack.append(u)  # the unit's backward follows at once, so it stays gathered
                self._gather(u, Phase.BACKWARD)  # until its gradients are in (on_group_complete)
                return
            if not self.stack:
                self._begin_forward()
            self.stack.append(u)
            i = self.fwd.visit(u.pos)
            self._gather(u, Phase.FORWARD)
            self._prefetch(self.fwd.ahead(i), Phase.PREFETCH_FORWARD)
        return hook

    def _hook_post_forward(self, u: Unit):
        def hook(module, args, output):
            if not self.stack or self.stack[-1] is not u:
                return  # forward raised before our pre-hook ran (nothing to undo)
            self.stack.pop()
            if self.running is Running.BACKWARD:
                return  # a recompute (see the pre-hook)
            if torch.is_grad_enabled():
                tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                if tensors:
                    register_multi_grad_hook(tensors, lambda grads, u=u: self._pre_backward(u), mode="any")
            for v in [u, *u.extern]:
                if v not in self.stack and not self._keep(v):
                    self._free(v)
            if not self.stack:
                self._end_forward()
        return hook

    def _begin_forward(self) -> None:
        # Full buffers left from an earlier pass (kept for a backward that never came) go first.
        for v in self.units:
            self._free(v)
        self.running = Running.FORWARD
        self.fwd = _Pass(self.fwd_trace)

    def _end_forward(self) -> None:
        rec = self.fwd.final()
        if rec is not None:
            self.fwd_trace = rec
        for v in self.units:  # prefetched but never used, or kept for a reuse that is not coming
            if not self._keep(v, after_forward=True):
                self._free(v)
        self.running = Running.IDLE
        # a skipped module may not show in the collectives (prefetched anyway): compare the orders
        self.guard.check_order(Phase.FORWARD, self.fwd.order, self._label)

    def _keep(self, u: Unit, after_forward: bool = False) -> bool:
        """Keep ``u`` gathered because it is used again soon (stage3_max_reuse_distance)?"""
        if self.limits.max_reuse <= 0 or self.live > self.limits.max_live or self.fwd is None:
            return False
        if u.state is ParamState.SHARDED or u.group is None:
            return False
        upcoming: list[int] = []
        if not after_forward and self.fwd.on_trace:
            upcoming += self.fwd.recorded[len(self.fwd.order):]
        if torch.is_grad_enabled() and self.bwd_trace is not None:
            upcoming += self.bwd_trace
        dist = 0
        for pos in upcoming:
            if pos == u.pos:
                return dist <= self.limits.max_reuse
            dist += self.units[pos].numel
            if dist > self.limits.max_reuse:
                return False
        return False

    # -- backward ------------------------------------------------------------------------
    def begin_backward(self) -> None:
        self.running = Running.BACKWARD
        self.bwd = _Pass(self.bwd_trace)

    def _pre_backward(self, u: Unit) -> None:
        if self.running is not Running.BACKWARD:
            self.begin_backward()  # a backward not started through engine.backward()
        i = self.bwd.visit(u.pos)
        self._gather(u, Phase.BACKWARD)
        for v in u.extern:
            self._gather(v, Phase.BACKWARD)
        self._prefetch(self.bwd.ahead(i), Phase.PREFETCH_BACKWARD)

    def on_group_complete(self, group_index: int) -> None:
        """The reducer has every gradient of this group for this backward: free the unit."""
        u = self.by_group.get(group_index)
        if u is not None and self.running is Running.BACKWARD:
            self._free(u)

    def end_backward(self) -> None:
        done, self.bwd = self.bwd, None
        if done is not None:
            rec = done.final()
            if rec is not None and rec:
                self.bwd_trace = rec
        self.free_all()
        if done is not None:
            self.guard.check_order(Phase.BACKWARD, done.order, self._label)

    def _label(self, pos: int) -> str:
        return self.units[pos].label

    # -- parameters read by another module -----------------------------------------------------
    def on_access(self, p: nn.Parameter) -> None:
        u = self.unit_of_param.get(id(p))
        if u is None or self.running is Running.IDLE:
            return  # outside forward/backward no collective is issued: the parameter stays empty
        if u.state is ParamState.GATHERED:
            return
        self._gather(u, Phase.ON_DEMAND)
        if self.stack and self.stack[-1] is not u:
            self.stack[-1].extern.add(u)

    def _swap_getattr(self) -> None:
        owners = set()
        for u in self.units:
            for slot in u.group.layout.slots if u.group is not None else ():
                for name in slot.aliases:
                    owners.add(name.rsplit(".", 1)[0] if "." in name else "")
        for path, m in self.root.named_modules():
            if path in owners:
                m.__class__ = _with_access_hook(type(m))
                m.__dict__["_zc_gatherer"] = self

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


_HOOKED: dict[type, type] = {}


def _with_access_hook(cls: type) -> type:
    """A subclass of ``cls`` whose attribute lookup of a parameter tells the gatherer (FSDP2 swaps
    module classes in the same way). nn.Module.__getattr__ only runs for names not found in the
    instance ``__dict__`` (parameters, buffers, submodules), so other attributes cost nothing."""
    if getattr(cls, "_zc_access_hooked", False):
        return cls
    if cls in _HOOKED:
        return _HOOKED[cls]

    def __getattr__(self, name):
        value = cls.__getattr__(self, name)
        if isinstance(value, nn.Parameter):
            g = self.__dict__.get("_zc_gatherer")
            if g is not None:
                g.on_access(value)
        return value

    new = type(cls.__name__, (cls,), {"__getattr__": __getattr__, "_zc_access_hooked": True,
                                      "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    _HOOKED[cls] = new
    return new
