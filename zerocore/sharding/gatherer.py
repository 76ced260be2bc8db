"""Stage 3 at run time: gather a unit's parameters when its module runs, free them after.

Forward: a unit's pre-forward hook gathers its group (waiting for a prefetch already in
flight) and puts the post-backward signal on the unit's inputs (``post_backward.py``), the
module runs, its post-forward hook frees the full buffer and registers a pre-backward
hook on the outputs' autograd nodes (as FSDP2 hooks its outputs; only its first call in a
backward does work). Backward: that hook re-gathers the unit just before its backward runs; when the
post-backward signal fires the unit's gradients are all in: the unit is freed and the
reducer handed its group, so at most the units whose backward is under way are resident.
Units the signal does not reach (inputs without gradient, the root, unused outputs) are
handled by the reducer at the end of backward.

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
the module tree): modules owning partitioned parameters get a ``__getattr__`` (``access.py``)
that gathers the owning unit on first access during forward or backward, frees it with the
module that used it, and re-gathers it before that module's backward. The pass recording and
the prefetch window are in ``passes.py``.

A forward entered below the root: PEFT's ``PeftModel.generate`` calls the wrapped model's forward,
not the root's, so the root unit (whatever no smaller unit took: a LoRA model's frozen embeddings,
say) would never be gathered. The wrappers between the root and the first units (``entry_modules``)
get the root unit's hooks too, which act only when no forward is under way: the pass is framed and
the root unit gathered exactly as if the root's own forward had been called.

Frozen parameters: a unit's frozen parameters are a group of their own (no gradients, no optimizer
state), gathered and freed together with the unit's trainable group (``Unit.extra``: its all-gather
is issued right before the trainable one's, so each rank issues both in the same order). A unit
with only frozen parameters gathers that group (``Unit.group``; ``Unit.trains`` False): its
post-backward signal frees it, and the reducer is told nothing (it has no gradients).
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import types
import weakref

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .._transforms import STAGE3_UNDER_TRANSFORM, differentiating_transform, peek_interpreter_stack
from .._weak import GONE, EngineGone, proxy, remove_when_freed
from ..comm import DONE, Comm
from ..comm.divergence import DivergenceGuard, Op, Phase
from ..ops.params import param_ops
from .access import make_traceable, restore, swap_class
from . import external
from .eager import eager_only
from .group import ShardedGroup
from .passes import Pass
from .post_backward import PostBackward
from .reducer import OUTSIDE_BACKWARD
from .state import ParamState, Tracked, param_state
from .units import entry_modules


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
    # the unit's frozen parameters when it also has trainable ones (else they are ``group``)
    extra: ShardedGroup | None = None
    handle: object = None  # the in-flight all-gather
    extra_handle: object = None  # ``extra``'s in-flight all-gather
    # positions of the units whose params this unit's forward read (positions, not Units: two units
    # reading each other's parameters would otherwise reference each other, a cycle)
    extern: set = dataclasses.field(default_factory=set)
    pending: int = 0  # post-backward Functions applied in forward whose backward has not run yet
    # a ``zerocore.gathered`` block gathered it: passes inside the block find it whole and leave it so (the
    # block frees it on exit); ``free_all`` (the end of a backward, before the step changes the chunks) ends that
    held: bool = False

    # Plain attributes, not properties: the hooks read them several times per unit per pass.
    padded: int = 0  # elements of the full (padded) buffers a gather brings in; 0 for an empty root
    tracked: Tracked = None  # the group's parameter state (an always-GATHERED one for an empty root)
    trains: bool = False  # ``group`` has gradients (the reducer is told when the unit's backward is over)

    def __post_init__(self):
        g, x = self.group, self.extra
        assert x is None or g is not None, "a unit's extra group goes with a group"
        self.padded = (g.layout.padded if g is not None else 0) + (x.layout.padded if x is not None else 0)
        self.tracked = g.param_state if g is not None else param_state(-1, ParamState.GATHERED)
        self.trains = g is not None and g.policy.trains

    def groups(self) -> list[ShardedGroup]:
        return [g for g in (self.group, self.extra) if g is not None]

    @property
    def label(self) -> str:
        return f"unit '{self.name or '<root>'}'"


@dataclasses.dataclass
class Limits:
    prefetch_elems: int  # stage3_prefetch_bucket_size
    max_live: int  # stage3_max_live_parameters
    max_reuse: int  # stage3_max_reuse_distance


class ParamGatherer:
    def __init__(self, root: nn.Module, units: list[tuple], comm: Comm, guard: DivergenceGuard, limits: Limits):
        """``units``: (module path, module, its group[, the group of its frozen parameters gathered
        with it]); a unit with only frozen parameters has their group as its group. The root module
        is always hooked (it frames each forward pass), with an empty unit if all its parameters
        went to other units."""
        if not any(u[1] is root for u in units):
            units = [("", root, None)] + list(units)
        self.root = root
        self.units = [Unit(i, *u) for i, u in enumerate(units)]
        self.comm = comm
        self.guard = guard
        self.limits = limits
        self.sizes = [u.padded for u in self.units]  # by position: what prefetch budgets count
        self.by_group = {g.index: u for u in self.units for g in u.groups()}
        self.unit_of_param = {id(p): u for u in self.units for g in u.groups() for p in g.params}
        self.running = Running.IDLE
        self.stack: list[Unit] = []  # units whose forward is running, innermost last
        self.fwd_trace: list[int] | None = None
        self.bwd_trace: list[int] | None = None
        self.fwd: Pass | None = None
        self.bwd: Pass | None = None
        self.live = 0  # elements gathered or being gathered
        self.peak_live = 0
        self.backwards = 0  # backward passes begun: a pre-backward hook works once per pass
        self.on_unit_done = None  # the reducer's group_done, called weakly (set by the engine): a unit's gradients are in
        # a backward the engine did not start reached a unit (loss.backward()): the engine opens it, or raises
        # (runtime/torch_backward.py; set by the engine, called weakly)
        self.on_outside = None
        self._call_before = param_ops().call_before_node  # a tensor's node runs: call fn() (post_backward.py)
        # The module hooks, the class swap and the post-backward signals live on the user's model and
        # reach this gatherer through a weak reference: the gatherer holds the modules, so a strong
        # reference back would be a cycle. If the gatherer is freed without remove_hooks() (an engine
        # dropped without destroy()), its hooks and class swaps are undone then.
        me = weakref.ref(self)
        self._hooks = []
        self._swapped: list = []
        remove_when_freed(self, self._hooks)
        remove_when_freed(self, self._swapped)
        for u in self.units:
            self._hooks.append(u.module.register_forward_pre_hook(self._hook_pre_forward(u, me)))
            self._hooks.append(u.module.register_forward_hook(self._hook_post_forward(u, me), always_call=True))
        self.entered: list[nn.Module] = []  # wrappers below the root whose forward framed the pass
        top = next(u for u in self.units if u.module is root)
        sizes = {id(p): s.numel for u in self.units for g in u.groups() for p, s in zip(g.params, g.layout.slots)}
        for m in entry_modules(root, [u.module for u in self.units], sizes):
            self._hooks.append(m.register_forward_pre_hook(self._hook_pre_entry(top, me)))
            self._hooks.append(m.register_forward_hook(self._hook_post_entry(top, me), always_call=True))
        self._swap_getattr()
        self._watched: set[int] = set()  # ids of the modules hooked for their registered external parameters
        for m in root.modules():
            if external.KEY in m.__dict__:
                self._hook_registered(m)
        external.track(self)

    # -- gather / free -------------------------------------------------------------------
    def _gather(self, u: Unit, phase: int, wait: bool = True) -> None:
        state = u.tracked.value
        if state is ParamState.SHARDED:
            if self.guard.enabled:
                self.guard.check(Op.GATHER, u.group.layout.index, phase)
            x = u.extra
            if x is not None:  # the unit's frozen parameters: their all-gather first, then the trainable one's
                h = x.start_gather(self.comm, async_op=True)
                u.extra_handle = None if h is DONE else h
            u.handle = u.group.start_gather(self.comm, async_op=True)
            self.live += u.padded
            if self.live > self.peak_live:
                self.peak_live = self.live
            if u.handle is DONE:  # a world of one: landed (and finished) already
                u.handle = None
                if u.extra_handle is not None:
                    self._wait_extra(u)
                return
        elif state is ParamState.GATHERED:
            return
        if wait:
            self._wait(u)

    def _wait(self, u: Unit) -> None:
        u.handle.wait()
        u.handle = None
        u.group.finish_gather()
        if u.extra is not None:
            self._wait_extra(u)

    @staticmethod
    def _wait_extra(u: Unit) -> None:
        h = u.extra_handle
        if h is not None:
            u.extra_handle = None
            h.wait()
        u.extra.finish_gather()

    def finish_prefetch(self, group_index: int) -> None:
        """Completes the all-gather in flight for this group, if any (``zerocore.gathered`` inside
        a forward); the unit stays the gatherer's to free."""
        u = self.by_group[group_index]
        if u.tracked.value is ParamState.GATHERING:
            self._wait(u)

    def _free(self, u: Unit) -> None:
        state = u.tracked.value
        if u.group is None or state is ParamState.SHARDED or u.held:
            return
        if state is ParamState.GATHERING:
            self._wait(u)
        u.group.free_full()
        if u.extra is not None:
            u.extra.free_full()
        self.live -= u.padded

    def free_all(self) -> None:
        """Every unit back to its owned chunk (before the optimizer step changes the chunks). After a
        backward (also one that raised): signals that never fired (unused outputs) are forgotten."""
        for u in self.units:
            u.pending = 0
            u.held = False  # the chunks may change now: a block's whole copy would go stale
            if u.tracked.value is not ParamState.SHARDED and u.group is not None:  # inline: most are sharded
                self._free(u)
        self.stack.clear()
        self.entered.clear()
        self.running = Running.IDLE

    def _arrive(self, u: Unit, run: Pass, phase: Phase, prefetch: Phase) -> None:
        """``u``'s forward or backward is about to run: recorded in the pass, gathered (or its
        prefetch waited for), and the next units of the recorded order prefetched."""
        i = run.visit(u.pos)
        if u.tracked.value is not ParamState.GATHERED:
            self._gather(u, phase)
        if run.on_trace and run.cursor < len(run.recorded):
            self._prefetch(run, i, prefetch)

    def _prefetch(self, run: Pass, i: int, phase: Phase) -> None:
        """Starts the gathers of the units after visit ``i`` of the recorded order, up to
        ``stage3_prefetch_bucket_size`` elements ahead and ``stage3_max_live_parameters`` resident."""
        for j in run.window(i, self.limits.prefetch_elems):
            v = self.units[run.recorded[j]]
            if v.tracked.value is ParamState.SHARDED:
                if self.live + v.padded > self.limits.max_live:
                    return  # offered again at the next visit, when something was freed
                self._gather(v, phase, wait=False)
            run.cursor = j + 1

    # -- forward -------------------------------------------------------------------------
    def _hook_pre_forward(self, u: Unit, me: weakref.ref):
        def hook(module, args):
            self = me()
            if self is None:
                raise EngineGone(GONE)
            if peek_interpreter_stack is not None and peek_interpreter_stack() is not None and \
                    differentiating_transform():  # before anything changes (the engine trains on after the error)
                raise RuntimeError(STAGE3_UNDER_TRANSFORM)
            if self.running is Running.BACKWARD:  # activation checkpointing recomputes inside backward:
                self.stack.append(u)  # the unit's backward follows at once, so it stays gathered
                self._gather(u, Phase.BACKWARD)  # until its gradients are in (its post-backward)
                return None
            if not self.stack:
                self._begin_forward()
            self.stack.append(u)
            self._arrive(u, self.fwd, Phase.FORWARD, Phase.PREFETCH_FORWARD)
            if u.group is not None and args and torch.is_grad_enabled():
                # The post-backward signal, made per call (a C-level partial, no Python frame): it lives
                # only in this forward's autograd graph. Kept on the unit it would be a cycle.
                done = functools.partial(self._post_backward, u)
                a = args[0]
                if len(args) == 1 and isinstance(a, torch.Tensor) and (a.grad_fn is not None or not a.requires_grad):
                    if a.requires_grad:  # the usual single non-leaf input: a node hook (post_backward.py)
                        self._call_before(a, done)
                        u.pending += 1
                    return None
                return self._post_backward_on(u, args, done)
            return None
        return eager_only(hook)

    def _hook_post_forward(self, u: Unit, me: weakref.ref):
        def hook(module, args, output):
            self = me()
            if self is None:
                raise EngineGone(GONE)
            if not self.stack or self.stack[-1] is not u:
                return  # forward raised before our pre-hook ran (nothing to undo)
            self.stack.pop()
            if self.running is Running.BACKWARD:
                return  # a recompute (see the pre-hook)
            flat = (output,) if isinstance(output, torch.Tensor) else tree_flatten(output)[0]
            # A partitioned parameter (or a view of one) returned to the caller, which reads it after this
            # forward (DeepSpeed's "dangling" external parameter: ``return out, self.bias``): its unit stays
            # gathered and becomes the caller's extern, freed after the caller's forward and gathered again
            # before the caller's backward. Inline (a dict lookup per output, no Python call): every unit's
            # forward passes here.
            handed, uop = (), self.unit_of_param
            for t in flat:
                if isinstance(t, torch.Tensor):
                    w = uop.get(id(t))
                    if w is None and t._base is not None:
                        w = uop.get(id(t._base))
                    if w is not None and self.stack:
                        handed += (w,)
                        if w not in self.stack:
                            self.stack[-1].extern.add(w.pos)
            if torch.is_grad_enabled() and (u.group is not None or u.extern):  # a pre-backward hook on each
                # output needing a gradient (FSDP2's way: a hook on the output's autograd node, native; the
                # first to fire in a backward gathers the unit). An empty root gathers nothing (unless it
                # read another's).
                hook_bwd = functools.partial(self._pre_backward_hook, u, [-1])
                call_before = self._call_before
                for t in flat:
                    if isinstance(t, torch.Tensor) and t.requires_grad and not call_before(t, hook_bwd):
                        t.register_hook(hook_bwd)  # an output no node made (a leaf)
            if u.extern or self.limits.max_reuse > 0:
                for v in [u, *map(self.units.__getitem__, u.extern)]:
                    if v not in self.stack and v not in handed and not (self.limits.max_reuse > 0 and self._keep(v)):
                        self._free(v)
            elif u.group is not None and u not in self.stack and u not in handed:
                self._free(u)
            if not self.stack:
                self._end_forward()
        return eager_only(hook)

    def _hook_pre_entry(self, u: Unit, me: weakref.ref):
        """The root unit's pre-forward hook on a wrapper below the root: works only for a forward
        that entered there (no pass under way), and then as the root's own."""
        root_pre = self._hook_pre_forward(u, me)

        def hook(module, args):
            self = me()
            if self is None:
                raise EngineGone(GONE)
            if self.stack or self.running is Running.BACKWARD:
                return None  # entered through the root, or a recompute inside backward: nothing to frame
            self.entered.append(module)
            return root_pre(module, args)
        return eager_only(hook)

    def _hook_post_entry(self, u: Unit, me: weakref.ref):
        root_post = self._hook_post_forward(u, me)

        def hook(module, args, output):
            self = me()
            if self is None:
                raise EngineGone(GONE)
            if not self.entered or self.entered[-1] is not module:
                return None  # its pre-hook framed nothing
            self.entered.pop()
            return root_post(module, args, output)
        return eager_only(hook)

    def _begin_forward(self) -> None:
        # Full buffers left from an earlier pass (kept for a backward that never came) go first.
        for v in self.units:
            if v.tracked.value is not ParamState.SHARDED and v.group is not None:
                self._free(v)
        self.running = Running.FORWARD
        self.fwd = Pass(self.fwd_trace, self.sizes)

    def _end_forward(self) -> None:
        rec = self.fwd.final()
        if rec is not None:
            self.fwd_trace = rec
        for v in self.units:  # prefetched but never used, or kept for a reuse that is not coming
            if v.tracked.value is not ParamState.SHARDED and v.group is not None and not (
                    self.limits.max_reuse > 0 and self._keep(v, after_forward=True)):
                self._free(v)
        self.running = Running.IDLE
        # a skipped module may not show in the collectives (prefetched anyway): compare the orders
        if self.guard.enabled:
            self.guard.check_order(Phase.FORWARD, self.fwd.order, self._label)

    def _keep(self, u: Unit, after_forward: bool = False) -> bool:
        """Keep ``u`` gathered because it is used again soon (stage3_max_reuse_distance)?"""
        if self.limits.max_reuse <= 0 or self.live > self.limits.max_live or self.fwd is None:
            return False
        if u.tracked.value is ParamState.SHARDED or u.group is None:
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
            dist += self.units[pos].padded
            if dist > self.limits.max_reuse:
                return False
        return False

    # -- backward ------------------------------------------------------------------------
    def begin_backward(self) -> None:
        self.running = Running.BACKWARD
        self.backwards += 1
        self.bwd = Pass(self.bwd_trace, self.sizes)

    def _pre_backward_hook(self, u: Unit, seen: list[int], grad=None) -> None:
        """A tensor hook on the outputs of one forward call of ``u``; ``seen``: the backward pass
        it last worked in (the other outputs' hooks return at once)."""
        if self.running is not Running.BACKWARD:
            if self.running is Running.FORWARD or self.on_outside is None:  # a backward inside a forward
                raise RuntimeError(OUTSIDE_BACKWARD)
            self.on_outside()  # loss.backward() through the engine: it opens the backward (begin_backward)
        if seen[0] == self.backwards:
            return
        seen[0] = self.backwards
        for pos in u.extern:
            self._gather(self.units[pos], Phase.BACKWARD)
        self._arrive(u, self.bwd, Phase.BACKWARD, Phase.PREFETCH_BACKWARD)

    def _post_backward_on(self, u: Unit, args: tuple, done) -> tuple | None:
        """Arranges ``u``'s post-backward signal on each of its inputs that needs a gradient
        (post_backward.py); returns the arguments to run the forward with (None: unchanged)."""
        new, routed = list(args), False
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.requires_grad:
                if a.grad_fn is not None:
                    self._call_before(a, done)
                else:  # a leaf lives on: a hook on it would stay; the Function's node goes with the graph
                    new[i], routed = PostBackward.apply(done, a)[0], True
                u.pending += 1
        return tuple(new) if routed else None

    def _post_backward(self, u: Unit, grad=None) -> None:
        """The post-backward signal of one input of one forward call of ``u``: when it was the
        last, the unit's gradients are all in: free it and hand its group to the reducer."""
        u.pending -= 1
        if u.pending > 0 or self.running is not Running.BACKWARD:
            return
        if u.tracked.value is ParamState.GATHERED and u not in self.stack:
            self._free(u)
        if self.on_unit_done is not None and u.trains:
            self.on_unit_done(u.group.layout.index)

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
            if self.guard.enabled:
                self.guard.check_order(Phase.BACKWARD, done.order, self._label)

    def _label(self, pos: int) -> str:
        return self.units[pos].label

    # -- parameters read by another module -----------------------------------------------------
    def on_access(self, p: nn.Parameter) -> None:
        u = self.unit_of_param.get(id(p))
        if u is None or self.running is Running.IDLE:
            return  # outside forward/backward no collective is issued: the parameter stays empty
        if u.tracked.value is ParamState.GATHERED:
            return
        self._lend(u)

    def _lend(self, u: Unit) -> None:
        """``u``'s parameters are read by the unit running now: gathered, and ``u`` that unit's extern (freed
        after its forward, gathered again before its backward)."""
        self._gather(u, Phase.ON_DEMAND)
        if self.stack and self.stack[-1] is not u:
            self.stack[-1].extern.add(u.pos)

    def watch_external(self, module: nn.Module) -> None:
        """A registration made after this gatherer was built (external.py): ``module`` is hooked if it is
        in this model (a module outside it is not ours)."""
        if any(m is module for m in self.root.modules()):
            self._hook_registered(module)

    def _hook_registered(self, module: nn.Module) -> None:
        """Hooks ``module``'s forward (once) to lend it the units of the parameters registered on it with
        ``register_external_parameter``."""
        if id(module) in self._watched:
            return
        self._watched.add(id(module))
        # registered after the units' hooks: when ``module`` is a unit, its own pre-hook has put it on the stack
        self._hooks.append(module.register_forward_pre_hook(self._hook_external(weakref.ref(self))))

    def _hook_external(self, me: weakref.ref):
        def hook(module, args):
            self = me()
            if self is None or self.running is Running.IDLE:
                return None  # outside a pass nothing is gathered (as on_access)
            for p in module.__dict__.get(external.KEY, ()):
                u = self.unit_of_param.get(id(p))
                if u is not None:  # a parameter of this engine's units (others are whole)
                    self._lend(u)
            return None
        return eager_only(hook)

    def _swap_getattr(self) -> None:
        """Every module registering a partitioned parameter gets the access-hooked class (access.py)."""
        modules = dict(self.root.named_modules(remove_duplicate=False))  # a shared module under each path
        owners = {id(modules[name.rpartition(".")[0]]): modules[name.rpartition(".")[0]]
                  for u in self.units for g in u.groups() for slot in g.layout.slots for name in slot.aliases}
        for m in owners.values():  # the modules get a weak proxy: they are the gatherer's, not its owners
            self._swapped.append(_Swapped(m, swap_class(m, proxy(self))))

    # -- torch.compile ------------------------------------------------------------------------
    def compile_units(self, **compile_kwargs) -> list[str]:
        """``torch.compile`` of each unit's forward on its own (FSDP2's recipe: ``fully_shard`` and
        compile each block): the unit's hooks (gather, free, the backward signals) stay eager module
        hooks around the compiled forward, so the forward is one graph with no collective or storage
        resize in it, and units of one class share that graph (their parameters are graph inputs of
        the same shapes). Units holding another unit, and the root (the glue between units), run
        eagerly. The access-hooked modules inside get a ``__getattr__`` Dynamo traces (``access.py``).
        Undone by ``remove_hooks``. Returns the paths of the units compiled."""
        unit_ids = {id(u.module) for u in self.units}
        swapped = {}  # id(module) -> its own class, for the modules still wearing the access hook
        for s in self._swapped:
            sm = s.module()
            if sm is not None and getattr(type(sm), "_zc_access_hooked", False) and type(sm).__bases__[0] is s.original:
                swapped[id(sm)] = (sm, s.original)
        done, compiled = [], {}
        for u in self.units:
            m = u.module
            if m is self.root or "forward" in m.__dict__ or any(id(x) in unit_ids for x in m.modules() if x is not m):
                continue
            cls = type(m).__bases__[0] if getattr(type(m), "_zc_access_hooked", False) else type(m)
            if cls not in compiled:
                compiled[cls] = torch.compile(_forward_of(cls), **unit_compile_kwargs(compile_kwargs))
            m.forward = types.MethodType(compiled[cls], m)
            self._hooks.append(_CompiledForward(m, compiled[cls]))
            for x in m.modules():
                if id(x) in swapped:
                    make_traceable(*swapped[id(x)])
            done.append(u.name)
        return done

    def swap_class(self, module: nn.Module, cls: type) -> None:
        """Gives ``module`` the class ``cls`` (a subclass of its own) while this gatherer works: the
        original comes back with ``remove_hooks`` (or when the gatherer is freed), as the access-hook
        swaps do (the Transformers integration swaps in a ``generate`` that syncs the ranks)."""
        self._swapped.append(_Swapped(module, type(module)))
        module.__class__ = cls

    def remove_hooks(self) -> None:
        """Removes the module hooks and gives the modules their own classes back (the last swap
        first: a module swapped twice gets its own class)."""
        external.untrack(self)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._watched.clear()
        for s in reversed(self._swapped):
            s.remove()
        self._swapped.clear()


_FORWARDS: dict[type, object] = {}


# Inductor's checks in the generated code of each graph call (sizes and strides of the fallback kernels'
# outputs, their alignment, scalar inputs): debugging aids of Inductor itself, off in Meta's own builds for
# alignment. A unit's graph runs once per unit per pass, so at stage 3 they are paid dozens of times a step:
# on a host-bound step (TinyGPT, 8 units, CPU) turning them off took 5% off the compiled step. Misaligned
# graph inputs are still copied by Inductor's runtime wrapper (copy_misaligned_inputs), whatever these say.
_UNIT_INDUCTOR_OPTIONS = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}


def unit_compile_kwargs(kwargs: dict) -> dict:
    """``torch.compile``'s arguments for a unit: the caller's, with Inductor's generated-code checks off
    unless the caller set them (its ``options`` win) or chose a ``mode`` (torch.compile takes a mode or
    options, not both) or another backend."""
    backend = kwargs.get("backend", "inductor")
    if "mode" in kwargs or not (backend == "inductor" or getattr(backend, "__name__", "") == "compile_fx"):
        return kwargs
    return {**kwargs, "options": {**_UNIT_INDUCTOR_OPTIONS, **(kwargs.get("options") or {})}}


def _forward_of(cls: type):
    """A function calling ``cls.forward``, with a code object of its own per class: Dynamo keeps its
    compiled graphs (and counts recompilations against its limit) per code object, so units of
    different classes do not share one cache (``torch.compile`` of a bound method of a ``torch.nn``
    class would put them all under one shared wrapper's code)."""
    fn = _FORWARDS.get(cls)
    if fn is None:
        forward = cls.forward

        def unit_forward(self, *args, **kwargs):
            return forward(self, *args, **kwargs)

        unit_forward.__code__ = unit_forward.__code__.replace(co_name=f"{cls.__name__}_forward")
        unit_forward.__name__ = unit_forward.__qualname__ = f"{cls.__name__}_forward"
        unit_forward.__wrapped__ = forward  # inspect.signature(module.forward) still names the forward's parameters
        fn = _FORWARDS[cls] = unit_forward
    return fn


class _CompiledForward:
    """A unit whose forward ``compile_units`` compiled: ``remove()`` gives it its own forward back."""

    __slots__ = ("module", "fn")

    def __init__(self, module: nn.Module, fn):
        self.module, self.fn = weakref.ref(module), fn

    def remove(self) -> None:
        m = self.module()
        if m is not None and getattr(m.__dict__.get("forward"), "__func__", None) is self.fn:
            del m.__dict__["forward"]  # only the forward set here (not one set over it since)


class _Swapped:
    """A module whose class the gatherer swapped (access.py), undone by ``remove()`` (as a hook
    handle is: ``remove_when_freed`` treats both alike)."""

    __slots__ = ("module", "original")

    def __init__(self, module: nn.Module, original: type):
        self.module, self.original = weakref.ref(module), original

    def remove(self) -> None:
        m = self.module()
        if m is not None:
            restore(m, self.original)
