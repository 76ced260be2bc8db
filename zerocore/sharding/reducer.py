"""GradReducer: each group's gradients reduced once per (reducing) backward, with one launch.

Stages 0/1 keep a full gradient buffer per group and every ``.grad`` is a view of it, so
autograd accumulates micro-batches in place and the reducer needs no hook at all: at the
accumulation boundary ``finish_backward`` reduces the groups in index order (a ``.grad`` that
was replaced behind our back is copied back into its view first).

Stages 2/3 leave ``.grad`` to autograd. Stage 2 counts arrivals with one cheap post-accumulate
hook per parameter (a closure per group: a set insert and a length test, nothing else); at
stage 3 the gatherer says when a unit's gradients are in (``group_done``, from the unit's
post-backward Function), with no per-parameter hook. When a
group has every gradient, or at the end of backward for groups with unused parameters, its
gradients are packed into a transient bucket with one multi-tensor call (``ops.pack``: gaps
and missing gradients zeroed), ``.grad`` is dropped, the bucket is reduced with one
collective, and its owned slice is added into the group's gradient shard. Buckets come from a
pool (two with ``overlap_comm``: one reducing while the next is packed) that is emptied at the
end of every backward, so between steps no bucket is held.

Groups are launched strictly in index order (group k only after groups < k), whatever order
their gradients complete in, so every rank issues the same collectives in the same order even
when ranks use different parameters. A completed group waiting behind an earlier one keeps its
gradients in ``.grad`` (what plain backward holds) until its turn.
gloo's async Work is only ever completed through ``wait()`` (it never reports ``is_completed()``).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from itertools import repeat
from operator import attrgetter, is_not

import weakref

import torch
from .. import ops
from .._weak import GONE, EngineGone, remove_when_freed
from ..ops.params import pack_grads_on
from ..profiling import label
from ..comm import DONE, Comm, Handle
from ..comm.divergence import Op, Phase
from .group import ShardedGroup, clear_grads_of
from .state import GradState

_HAS_GRAD = attrgetter("has_grad")
_GRAD = attrgetter("grad")
OUTSIDE_BACKWARD = ("zerocore: a gradient arrived outside any backward this engine can see: call "
                    "engine.backward(loss), or loss.backward() on a loss computed from the engine's outputs "
                    "(engine(x), not engine.module(x)), so loss scaling and gradient reduction happen")


class BucketPool:
    """Transient buckets, all ``numel`` long, at most ``cap`` alive; ``release`` drops them all."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, cap: int):
        self.numel, self.dtype, self.device, self.cap = numel, dtype, device, cap
        self.free: list[torch.Tensor] = []
        self.all: list[torch.Tensor] = []

    def take(self) -> torch.Tensor | None:
        if self.free:
            return self.free.pop()
        if len(self.all) < self.cap:
            b = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            self.all.append(b)
            return b
        return None

    def release(self) -> None:
        self.free.clear()
        self.all.clear()


class GradReducer:
    def __init__(self, groups: list[ShardedGroup], comm: Comm, *, overlap: bool, reduce_scatter: bool,
                 device: torch.device, guard=None, on_complete: Callable[[int], None] | None = None,
                 on_reduced: Callable[[int], None] | None = None, reduce_dtype: torch.dtype | None = None,
                 unit_signals: bool = False, outside: Callable[[], None] | None = None):
        """``guard``: a DivergenceGuard checked before each reduction (stage 3); ``on_complete(k)``:
        called once per backward when group k has every gradient (stage 3 frees the unit);
        ``on_reduced(k)``: called once per reducing backward when group k's owned reduced slice
        (``group.owned_grad()``) is final (state HELD). ``reduce_dtype``: the dtype collectives
        sum in (None: the training dtype). ``unit_signals`` (stage 3): no per-parameter hook; the
        gatherer calls ``group_done(k)`` when a unit's gradients are in. ``outside()``: a gradient came
        while no backward was open (a ``loss.backward()`` the engine did not start): it opens one
        (``begin_backward(late=True)``) or raises (runtime/torch_backward.py)."""
        self.groups = groups
        self.outside = outside
        self.comm = comm
        self.guard = guard
        self.on_complete = on_complete
        self.on_reduced = on_reduced
        self.overlap = overlap
        # reduce_scatter False = DeepSpeed's all-reduce of whole buckets; on gloo the comm layer
        # runs both as an all-reduce (measured faster there). Stage 0 steps the whole group on
        # every rank, so it needs the whole sum: always an all-reduce.
        sharded = bool(groups) and groups[0].policy.shard_optimizer
        self._reduce = comm.reduce_scatter if reduce_scatter and sharded else comm.all_reduce
        self.full_grads = bool(groups) and groups[0].policy.keep_full_grads
        # stages 0/1 with a buffer wider than the parameters (fp32 accumulation of bf16): .grad is each backward's
        # own, added into the buffer at its end; the buffer's dtype is what reduces
        self._unbound = bool(groups) and groups[0].grad_unbound
        train_dtype = (groups[0].grad_full.dtype if self.full_grads else groups[0].layout.dtype) if groups else \
            torch.float32
        self.reduce_dtype = reduce_dtype or train_dtype
        self.pool = None
        if groups and (not self.full_grads or self.reduce_dtype != train_dtype):
            self.pool = BucketPool(max(g.layout.padded for g in groups), self.reduce_dtype, device,
                                   cap=2 if overlap else 1)
        # stages 2/3 with reduce_dtype: gradients are packed in their own dtype, then converted
        self._staging = reduce_dtype is not None and reduce_dtype != train_dtype and not self.full_grads
        self.buckets: dict[int, torch.Tensor] = {}  # group -> its bucket while reducing
        self.inflight: deque[tuple[int, Handle]] = deque()
        self._arrived: list[set[int]] = [set() for _ in groups]
        self._done = [False] * len(groups)  # group k has every gradient of this backward
        self.unit_signals = unit_signals
        self.launched = [False] * len(groups)
        self.next_launch = 0
        self.reducing = False  # does this backward reduce (always at stage 2; at the boundary at 0/1)?
        # engine.coalesce_grad_reduction(): backwards reduce nothing (stages 2/3 too: gradients stay in .grad, summed
        # by autograd) until the block's end runs the boundary pass (runtime/coalesced_reduction.py)
        self.deferred = False
        self.deferred_backwards = 0  # backwards finished while deferred (since the last pass)
        self.in_backward = False
        self.grad_factor = 1.0  # what this backward's gradients are multiplied by as they are added in
        # A backward that raises must leave the gradients as they were before it:
        self._fresh = False  # stages 0/1, a later micro-batch of a window: autograd writes fresh .grad
        self._had_grad: list[bool] = []  # stages 2/3: which owned slices held earlier micro-batches
        self._added: list[int] = []  # stages 2/3: groups this backward added into their slices
        self.window_lost: str | None = None  # why the accumulated gradients of this window are unusable
        self._pack_grads = pack_grads_on(device)
        # The hooks live on the user's parameters and reach this reducer through a weak reference
        # (a strong one would close a cycle through C++-held hooks that the collector cannot see);
        # they are removed with the reducer if it is freed without remove_hooks().
        me = weakref.ref(self)
        if self.full_grads:  # one hook per group, not per parameter: catches a plain loss.backward()
            hook = _inside_check(me)
            self._hooks = [g.params[0].register_post_accumulate_grad_hook(hook) for g in groups]
        elif unit_signals:  # stage 3: units signal through the gatherer; the persistent groups (no unit) get
            # stages 0/1's check, which a loss.backward() reaching only them needs to be seen
            hook = _inside_check(me)
            self._hooks = [g.params[0].register_post_accumulate_grad_hook(hook) for g in groups if not g.partitioned]
        else:
            self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(k, me))
                           for k, g in enumerate(groups) for p in g.params]
        remove_when_freed(self, self._hooks)
        for g in groups:
            g.bind_grads()

    # -- backward ------------------------------------------------------------------------
    def _opened_outside(self) -> None:
        if self.outside is None:
            raise RuntimeError(OUTSIDE_BACKWARD)
        self.outside()
        if not self.in_backward:
            raise RuntimeError(OUTSIDE_BACKWARD)

    def check_late(self, grad_factor: float) -> None:
        """Whether a backward first seen after some of its gradients landed can still be scaled by
        ``grad_factor``: stages 2/3 scale as they add the reduced gradients in, always; stages 0/1's
        buffer already holds them in place, summed with earlier micro-batches of the window unless
        this is its first."""
        if (self.full_grads and not self._unbound and grad_factor != 1.0
                and self.holds_gradients()):
            self.window_lost = ("a loss.backward() the engine saw only after its gradients were summed into the "
                                "window's")
            raise RuntimeError(
                "zerocore: loss.backward() on a loss computed from engine.module(x) (not engine(x)) in a later "
                "micro-batch of a gradient accumulation window at ZeRO stage 0/1: its gradients were summed into "
                "the window's before the engine saw the backward, so they cannot be divided by "
                "gradient_accumulation_steps; call engine.zero_grad() (this window's gradients are mixed now), "
                "then call the model through the engine (engine(x)), or use engine.backward(loss)")

    def begin_backward(self, boundary: bool, grad_factor: float = 1.0, late: bool = False) -> None:
        """``grad_factor``: this backward's gradients are multiplied by it as they are added in (a
        ``loss.backward()`` through the engine: 1/gradient_accumulation_steps, which engine.backward
        puts on the loss). ``late``: some of its gradients have landed already (stages 0/1: in the
        buffer, so they are not taken out of it as a later micro-batch's are)."""
        if self.in_backward:
            raise RuntimeError("zerocore: backward called again before the previous one finished")
        if self.deferred and not self.full_grads and grad_factor != 1.0:
            raise RuntimeError(
                "zerocore: loss.backward() inside coalesce_grad_reduction() at ZeRO stage 2/3 with "
                "gradient_accumulation_steps > 1: its 1/gradient_accumulation_steps is applied as gradients are "
                "reduced, and the block sums them in .grad first; call engine.backward(loss) inside the block")
        self.in_backward = True
        self.grad_factor = grad_factor
        self.reducing = (boundary or not self.full_grads) and not self.deferred
        if not self.unit_signals:
            for s in self._arrived:
                s.clear()
        self._done = [False] * len(self.groups)
        self.launched = [False] * len(self.groups)
        self.next_launch = 0
        if self.full_grads:
            # After the first micro-batch of a window the buffer holds earlier ones: autograd then
            # writes fresh gradients (added in at the end), so a failure can drop them exactly.
            self._fresh = False
            for g in self.groups:
                if g.grad_state == GradState.EMPTY:
                    g.grad_state.to(GradState.FILLING)
                else:
                    self._fresh = not late
            if self._unbound:  # .grad is None between backwards (or holds this one's first gradients, late)
                self._fresh = True
            elif self._fresh:
                for g in self.groups:
                    for p in g.params:  # a plain loop: no Python call per parameter
                        p.grad = None
        else:
            self._had_grad = list(map(_HAS_GRAD, self.groups))
            self._added = []

    def _make_hook(self, k: int, me: weakref.ref):
        """The post-accumulate hook of group k's parameters: counts, and at the last one hands
        the group on. One Python call per parameter, no tensor work."""
        arrived, n = self._arrived[k], len(self.groups[k].params)

        def hook(p: torch.nn.Parameter) -> None:
            self = me()
            if self is None:
                raise EngineGone(GONE)
            if not self.in_backward:
                self._opened_outside()
            if self.launched[k]:
                g = self.groups[k]
                name = next(s.name for s, q in zip(g.layout.slots, g.params) if q is p)
                raise RuntimeError(f"zerocore: gradient of '{name}' arrived after its bucket was reduced (a second "
                                   "backward through it?); reentrant backward is not supported")
            if id(p) in arrived:  # reached twice in one backward: autograd summed it in .grad
                return
            arrived.add(id(p))
            if len(arrived) == n:
                self._done[k] = True
                if self.on_complete is not None:
                    self.on_complete(k)
                self._launch_ready(k)
        return hook

    def group_done(self, k: int) -> None:
        """Stage 3: unit k's backward is over (its post-backward Function fired; the gatherer has
        freed it): its gradients are in ``.grad``."""
        if not self.in_backward:
            self._opened_outside()
        if not self._done[k]:
            self._done[k] = True
            self._launch_ready(k)

    def _launch_ready(self, k: int) -> None:
        """Group k is done: launch it and the done groups after it, in index order."""
        if self.reducing and k == self.next_launch:
            done, n = self._done, len(self.groups)
            while self.next_launch < n and done[self.next_launch]:
                self._launch(self.next_launch)

    def _take_bucket(self) -> torch.Tensor:
        pool = self.pool
        while not pool.free and len(pool.all) >= pool.cap:  # every bucket is reducing: the oldest lands first
            self._finish_oldest()
        return pool.free.pop() if pool.free else pool.take()

    def _launch(self, k: int) -> None:
        """Group k's gradients into a bucket (stages 2/3; stages 0/1 reduce the full buffer) and
        its reduction issued: the whole per-group hot path of a backward, in one frame."""
        g = self.groups[k]
        gs = g.grad_state
        if gs.value is not GradState.FILLING:
            gs.to(GradState.FILLING)
        if self.full_grads:
            flat = g.grad_full
            if self.pool is not None:  # reduce_dtype wider than the buffer: reduce a converted copy
                b = self._take_bucket()
                self.buckets[k] = b
                flat = b[:g.layout.padded]
                flat.copy_(g.grad_full)
        else:  # stages 2/3: the gradients into a bucket with one call, .grad dropped
            b = self._take_bucket()
            self.buckets[k] = b
            flat = b if g.layout.padded == self.pool.numel else b[:g.layout.padded]  # a slice costs ~0.7 us
            dst = torch.empty(g.layout.padded, dtype=g.layout.dtype, device=b.device) if self._staging else flat
            if not self._pack_grads(g.params, g.grad_offsets, dst):  # one native call, else the checked op
                _pack_checked(g, dst)
            if self._staging:
                flat.copy_(dst)
        if self.guard is not None:
            self.guard.check(Op.REDUCE, k, Phase.BACKWARD)
        gs.to(GradState.REDUCING)
        self.launched[k] = True
        self.next_launch = k + 1
        with label("zerocore.reduce"):
            handle = self._reduce(flat, async_op=self.overlap)
        self.inflight.append((k, handle))
        if not self.overlap:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        k, handle = self.inflight.popleft()
        if handle is not DONE:
            handle.wait()
        g = self.groups[k]
        b = self.buckets.pop(k, None)
        if self.full_grads:
            if b is not None:
                g.grad_full.copy_(b[:g.layout.padded])
                self.pool.free.append(b)
        else:
            mine = b if g.hi - g.lo == self.pool.numel else b[g.lo:g.hi]
            if g.grad_released:  # offload gave its memory back after the last boundary (ShardedGroup.release_grad)
                g.reacquire_grad()
            f = self.grad_factor
            if g.has_grad:
                g.grad_shard.add_(mine) if f == 1.0 else g.grad_shard.add_(mine, alpha=f)
            else:
                g.grad_shard.copy_(mine)
                if f != 1.0:
                    g.grad_shard.mul_(f)
            self.pool.free.append(b)
            self._added.append(k)
        g.has_grad = True
        g.grad_state.to(GradState.HELD)
        if self.on_reduced is not None:
            self.on_reduced(k)

    def _rebind_full_grads(self, add: bool = False, keep: bool = True, factor: float = 1.0) -> None:
        """Stages 0/1: a ``.grad`` that is no longer its view (a fresh gradient of a later micro-batch,
        or one made after the user reset it) goes into the buffer (``add``: summed with the earlier
        micro-batches; ``keep`` False: dropped); identity tests only when nothing moved. ``factor``:
        this backward's gradients times it (the fresh ones as they are added; else the whole buffer,
        which then holds this backward's only)."""
        for g in self.groups:
            if g.grad_unbound:  # each backward's own .grad, into the wider buffer, then dropped
                for p, v in zip(g.params, g.grad_views):
                    if p.grad is not None and keep:
                        v.add_(p.grad) if factor == 1.0 else v.add_(p.grad, alpha=factor)
                    p.grad = None
                continue
            for p, v in zip(g.params, g.grad_views):  # a plain loop: no Python call per parameter
                if p.grad is not v:
                    if p.grad is not None and keep:
                        if add:
                            v.add_(p.grad) if factor == 1.0 else v.add_(p.grad, alpha=factor)
                        else:
                            v.copy_(p.grad)
                    p.grad = v
            if factor != 1.0 and not add and keep:
                g.grad_full.mul_(factor)

    def finish_backward(self) -> None:
        """Launches what is still pending (all groups at stages 0/1; groups with parameters that got
        no gradient at 2/3, their slots zero) and waits for every reduction."""
        if not self.in_backward:
            return
        try:
            with label("zerocore.finish_backward"):
                if self.full_grads:
                    self._rebind_full_grads(add=self._fresh, factor=self.grad_factor)
                elif self.on_complete is not None:
                    for k in range(len(self.groups)):
                        if not self._done[k]:
                            self.on_complete(k)
                if self.reducing:
                    while self.next_launch < len(self.groups):
                        self._launch(self.next_launch)
                while self.inflight:
                    self._finish_oldest()
                if self.unit_signals and self.reducing:
                    self._reduce_late()
        finally:
            self.in_backward = False
            if self.pool is not None:
                self.pool.release()
        if self.deferred:
            self.deferred_backwards += 1

    def reduce_held(self, boundary: bool) -> None:
        """A reduction pass with no autograd in it, over the gradients held now (stages 0/1: the full buffer, reduced
        at the boundary; stages 2/3: ``.grad`` packed into the shards): the end of an unmanaged accumulation window
        (runtime/unmanaged_window.py) and of a coalesce_grad_reduction() block (runtime/coalesced_reduction.py).
        A reduction that raises is aborted as a backward's is."""
        self.begin_backward(boundary)
        try:
            self.finish_backward()
        except BaseException:
            self.abort()
            raise

    def _reduce_late(self) -> None:
        """Stage 3: gradients that arrived after their unit's post-backward (a parameter used on
        a path that does not lead to the unit's inputs, after them) are reduced once more and
        added. Every rank runs the same graph, so all relaunch the same groups in the same order."""
        for k, g in enumerate(self.groups):
            if any(map(is_not, map(_GRAD, g.params), repeat(None))):  # C-level: no Python line per parameter
                self._launch(k)
        while self.inflight:
            self._finish_oldest()

    def abort(self) -> None:
        """A backward that raised: its in-flight reductions drained, its buckets dropped, and the
        gradients put back as they were before it. Stages 0/1: its fresh gradients dropped (a later
        micro-batch of a window), or the buffer zeroed (the first). Stages 2/3: slices it made are
        forgotten; one it added into after earlier micro-batches cannot be taken apart again, so
        ``window_lost`` says so and the engine refuses that window's step (named, not silent)."""
        while self.inflight:
            k, handle = self.inflight.popleft()
            try:
                handle.wait()
            finally:
                self.groups[k].grad_state.abort(GradState.HELD if self.groups[k].has_grad else GradState.FILLING)
        self.buckets.clear()
        if self.full_grads:
            if not self._fresh:  # the window's first micro-batch accumulated into the buffer itself
                for g in self.groups:
                    g.grad_full.zero_()
                    g.grad_state.abort(GradState.EMPTY)
            self._rebind_full_grads(keep=False)
        else:
            for g in self.groups:
                for p in g.params:
                    p.grad = None
            if self.deferred and self.deferred_backwards:
                self.window_lost = ("a backward inside coalesce_grad_reduction() raised: the gradients the block's "
                                    "earlier backwards left in .grad were dropped with its own")
            for k in self._added:
                g = self.groups[k]
                if self._had_grad[k]:
                    self.window_lost = (f"a backward raised after group {k}'s reduced gradients were added to the "
                                        "micro-batches accumulated before it")
                else:
                    g.has_grad = False
                    g.grad_state.abort(GradState.EMPTY)
        if self.pool is not None:
            self.pool.release()
        self.in_backward = False

    def holds_gradients(self) -> bool:
        """Whether some group holds gradients of a window that has not stepped yet."""
        return any(g.grad_state != GradState.EMPTY for g in self.groups)

    def clear(self) -> None:
        """Forgets all gradients of this optimizer step."""
        if self.in_backward or self.inflight:
            raise RuntimeError("zerocore: zero_grad() during backward")
        clear_grads_of(self.groups)
        self.window_lost = None
        self.deferred_backwards = 0

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def bucket_tensors(self) -> list[torch.Tensor]:
        return list(self.pool.all) if self.pool is not None else []


def _inside_check(me: weakref.ref):
    """Stages 0/1's hook (stage 3's for persistent parameters): a gradient with no backward open opens one
    (a loss.backward() the engine did not start), or is an error."""
    def check_inside(p: torch.nn.Parameter) -> None:
        self = me()
        if self is None:
            raise EngineGone(GONE)
        if not self.in_backward:
            self._opened_outside()
    return check_inside


def _pack_checked(g: ShardedGroup, dst: torch.Tensor) -> None:
    """Group ``g``'s gradients into ``dst`` through the checked op (gaps zeroed), ``.grad`` dropped:
    for gradients the native fast path refuses (another dtype or layout)."""
    grads, offs = [], []
    for off, p in zip(g.grad_offsets, g.params):
        if p.grad is not None:
            grads.append(p.grad)
            offs.append(off)
            p.grad = None
    try:  # checks every tensor before writing anything
        ops.pack(grads, offs, dst)
    except (TypeError, ValueError, RuntimeError):  # a gradient in another dtype or layout
        dst.zero_()
        for t, o in zip(grads, offs):
            dst[o:o + t.numel()].copy_(t.reshape(-1))
