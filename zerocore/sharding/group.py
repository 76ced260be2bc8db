"""A flat group at run time: the layout record plus the tensors one rank holds for it.

The model's parameters become views into ``param_flat`` (so the all-gather after the step
updates the model in place); with full gradients kept (stages 0/1) ``param.grad`` is a view
into ``grad_full`` too, so autograd accumulates micro-batches straight into the bucket.

Stage 3 (``policy.keep_full_params`` false) keeps the owned chunk in ``param_shard`` and
allocates ``param_flat`` only while gathered: its storage is resized to zero bytes when freed
and back when gathered (as FSDP2 does), so views of it that autograd saved during forward see
the re-gathered values in backward. While sharded, every parameter's ``.data`` is an empty
tensor (DeepSpeed's convention): a stray read fails on the shape instead of reading freed memory.
"""
from __future__ import annotations

import torch

from ..comm.collectives import DONE
from .policy import StagePolicy
from .records import FlatGroup
from .state import GradState, ParamState, grad_state, param_state


class ShardedGroup:
    def __init__(self, layout: FlatGroup, params: list[torch.nn.Parameter], policy: StagePolicy, rank: int,
                 device: torch.device, param_flat: torch.Tensor | None = None):
        assert len(params) == len(layout.slots)
        self.layout = layout
        self.params = params
        self.policy = policy
        parts = policy.partitions(layout.world)
        self.lo, self.hi = layout.range_of(rank if parts > 1 else 0, parts)
        if param_flat is None:
            param_flat = torch.zeros(layout.padded, dtype=layout.dtype, device=device)
        assert param_flat.numel() == layout.padded and param_flat.dtype == layout.dtype
        self.param_flat = param_flat
        self.param_state = param_state(layout.index, ParamState.GATHERED)
        self.partitioned = not policy.keep_full_params
        # Stage 3: the owned chunk of the parameters, the only part kept between uses.
        self.param_shard = param_flat[self.lo:self.hi].clone() if self.partitioned else None
        self._views: list[torch.Tensor] = []
        self._empty = torch.empty(0, dtype=layout.dtype, device=device)
        self.grad_state = grad_state(layout.index)
        # Stages 0/1: the full gradient buffer; stage 2+: only the owned, reduced slice.
        self.grad_full = (torch.zeros(layout.padded, dtype=layout.dtype, device=device)
                          if policy.keep_full_grads else None)
        self.grad_shard = (None if policy.keep_full_grads
                           else torch.zeros(self.hi - self.lo, dtype=layout.dtype, device=device))
        self.has_grad = False  # the owned slice holds a gradient of this optimizer step
        # Offload (zerocore.offload): ``ready`` is set when this step's host update is in the owned
        # parameters (reads and gathers wait for it: each unit waits only for its own);
        # ``on_gather(index)`` records the order units are gathered in (the next step's order).
        self.ready = None
        self.on_gather = None
        self.params_on_host = False  # stage-3 parameter offload: param_shard rests in host memory
        self._staged = None  # the device copy of a host-resident shard while its all-gather runs
        self.defer_gather = False  # set by offload for the first gather after a queued host step
        self.grad_views: list[torch.Tensor] = []  # stages 0/1: each parameter's view of grad_full, made once
        self.full_bytes = layout.padded * param_flat.element_size()  # a plain attribute: read per gather
        # Stage 3 (set by the gatherer, access.py): (module __dict__, its _parameters, name, parameter)
        # of every attribute naming one of these parameters. While gathered the parameter sits in the
        # module's __dict__ as well, so reading it is a plain attribute lookup with no Python call.
        self.shadows: list[tuple[dict, dict, str, torch.nn.Parameter]] = []

    @property
    def index(self) -> int:
        return self.layout.index

    def owned_params(self) -> torch.Tensor:
        """The owned range of the parameters, holding every update stepped so far."""
        if self.ready is not None:
            self.ready.wait()
        return self.param_shard if self.partitioned else self.param_flat[self.lo:self.hi]

    def owned_params_raw(self) -> torch.Tensor:
        """The owned range as it is now (the offload worker writes into it)."""
        return self.param_shard if self.partitioned else self.param_flat[self.lo:self.hi]

    def offload_params(self, pin: bool) -> None:
        """Stage-3 parameter offload: the owned shard moves to host memory (page-locked when ``pin``)."""
        assert self.partitioned
        host = torch.empty(self.param_shard.numel(), dtype=self.param_shard.dtype, device="cpu", pin_memory=pin)
        host.copy_(self.param_shard)
        self.param_shard = host
        self.params_on_host = True

    # -- stage 3: gather / free ------------------------------------------------------------
    # The hot path of stage 3 (twice per unit per step): the state transitions are tested and
    # assigned inline; an illegal one still goes through ``Tracked.to``, which raises naming both.
    def start_gather(self, comm, async_op: bool = True):
        """Allocates the full buffer and starts the all-gather of every rank's chunk into it.
        Offloaded: first waits for this group's host step (only this group's), and copies a
        host-resident shard to the device (on the stream the all-gather follows). The owned
        chunk is read through ``owned_params()`` (offload hooks in there). A collective that
        completed at once (a world of one) leaves the group GATHERED and returns ``DONE``."""
        if self.on_gather is not None:
            self.on_gather(self.layout.index)
        ps = self.param_state
        if ps.value is not ParamState.SHARDED:
            ps.to(ParamState.GATHERING)  # raises: illegal transition
        ps.value = ParamState.GATHERING
        st = self.param_flat.untyped_storage()
        if st.nbytes() != self.full_bytes:
            st.resize_(self.full_bytes)
        if self.defer_gather and async_op:
            # A prefetch right after an offloaded step must not block on this group's host step
            # (which runs while earlier units compute): the all-gather is issued when the unit is
            # waited for. Decided by this flag, never by timing, so every rank issues its
            # collectives in the same order.
            self.defer_gather = False
            return _DeferredGather(self, comm)
        # owned_params(), inline where it has nothing to wait for (the hot path of every gather)
        mine = self.param_shard if self.ready is None and self.partitioned else self.owned_params()
        if mine.device != self.param_flat.device:  # a host-resident shard: to the device first
            self._staged = mine.to(self.param_flat.device, non_blocking=True)
            mine = self._staged
        handle = comm.all_gather_into(self.param_flat, mine, async_op=async_op)
        if handle is DONE:  # landed already: finish_gather, inline (the hot path of a world of one)
            ps.value = ParamState.GATHERED
            self._staged = None  # the device copy of a host-resident shard is done with
            for p, v in zip(self.params, self._views):
                p.data = v
            for d, registered, name, p in self.shadows:
                if registered.get(name) is p:
                    d[name] = p
        return handle

    def _issue_gather(self, comm, async_op: bool):
        mine = self.owned_params()
        if mine.device != self.param_flat.device:
            self._staged = mine.to(self.param_flat.device, non_blocking=True)
            mine = self._staged
        return comm.all_gather_into(self.param_flat, mine, async_op=async_op)

    def finish_gather(self) -> None:
        """The all-gather has landed: the parameters show their full values (idempotent)."""
        ps = self.param_state
        if ps.value is ParamState.GATHERED:
            return
        if ps.value is not ParamState.GATHERING:
            ps.to(ParamState.GATHERED)  # raises unless legal
        ps.value = ParamState.GATHERED
        self._staged = None
        for p, v in zip(self.params, self._views):
            p.data = v
        for d, registered, name, p in self.shadows:  # plain attribute reads from now on (access.py)
            if registered.get(name) is p:
                d[name] = p

    def free_full(self) -> None:
        """Back to the owned chunk only: the full buffer's bytes are released."""
        ps = self.param_state
        if ps.value is not ParamState.GATHERED:
            ps.to(ParamState.SHARDED)  # raises unless legal
        ps.value = ParamState.SHARDED
        for d, _, name, _ in self.shadows:  # reads go through the access hook again
            d.pop(name, None)
        for p in self.params:
            p.data = self._empty
        self.param_flat.untyped_storage().resize_(0)

    def owned_grad(self) -> torch.Tensor:
        """The reduced gradient of the owned range (valid in state HELD)."""
        self.grad_state.expect(GradState.HELD)
        return self.grad_full[self.lo:self.hi] if self.grad_full is not None else self.grad_shard

    def bind_params(self) -> None:
        """Makes every parameter a view of its slot in ``param_flat``."""
        self._views = [self.param_flat[slot.offset:slot.end].view(slot.shape) for slot in self.layout.slots]
        for p, v in zip(self.params, self._views):
            p.data = v

    def grad_view(self, i: int) -> torch.Tensor:
        slot = self.layout.slots[i]
        return self.grad_full[slot.offset:slot.end].view(slot.shape)

    def bind_grads(self) -> None:
        """Stages 0/1: every parameter's ``.grad`` is a view of its slot in ``grad_full``."""
        if self.grad_full is not None:
            if not self.grad_views:  # the same view objects every step: the reducer tests ``p.grad is view``
                self.grad_views = [self.grad_view(i) for i in range(len(self.params))]
            for p, v in zip(self.params, self.grad_views):
                p.grad = v

    def clear_grads(self) -> None:
        """Forgets this step's gradients (after the optimizer step, or zero_grad)."""
        clear_grads_of([self])

    def tensors(self) -> dict[str, torch.Tensor | None]:
        """The tensors this group holds, by role (for memory accounting)."""
        grads = self.grad_full if self.grad_full is not None else self.grad_shard
        if self.partitioned:  # the full buffer counts only while gathered (its storage is resized)
            shard_role = "host_params" if self.params_on_host else "params"
            return {shard_role: self.param_shard, "gathered": self.param_flat, "grads": grads, "staged": self._staged}
        return {"params": self.param_flat, "grads": grads}


class _DeferredGather:
    """The all-gather of a group whose host step may still be running: issued at ``wait()``."""

    def __init__(self, group: ShardedGroup, comm):
        self.group, self.comm = group, comm
        self.done = False

    def wait(self) -> None:
        if not self.done:
            self.done = True
            self.group._issue_gather(self.comm, async_op=False)


_CLEARABLE = (GradState.EMPTY, GradState.FILLING, GradState.HELD)


def clear_grads_of(groups: list[ShardedGroup]) -> None:
    """``clear_grads`` of many groups with no Python call per group (the reducer clears every
    group after every step; at stage 3 that is one group per unit)."""
    empty = GradState.EMPTY
    for g in groups:
        st = g.grad_state
        if st.value not in _CLEARABLE:
            st.expect(*_CLEARABLE)  # raises, naming the group and its state
        if g.grad_full is not None:
            g.grad_full.zero_()
            g.bind_grads()
        else:
            for p in g.params:
                p.grad = None
        g.has_grad = False
        st.value = empty  # what st.to(EMPTY) checks: EMPTY is reachable from every state in _CLEARABLE
