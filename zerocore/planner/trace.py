"""One training step of a dry engine traced on fake tensors with torch's ``MemTracker``: the live
bytes after every op, hence the peak, with what the engine held at that moment by role.

``MemTracker`` (torch.distributed._tools.mem_tracker) counts every storage an op creates, follows
``UntypedStorage.resize_`` (stage 3 frees and re-gathers a unit that way) and drops a storage when
it dies. What it does not do, and this module adds: it knows nothing of the engine's roles (it
sees parameters, gradients and "other"), so the breakdown at the peak is taken from the dry
engine itself; and its peak is read per device, where a CPU training device shares one figure
with the host placements.
"""
from __future__ import annotations

import dataclasses
import warnings

from torch.distributed._tools.mem_tracker import MemTracker

from .dry_engine import DryEngine

_TOTAL = "Total"


@dataclasses.dataclass
class StepMemory:
    between: dict[str, int]  # held_bytes roles between steps (+ "total", "host_total")
    peak: int  # live tensor bytes at the step's peak, every device together
    at_peak: dict[str, int]  # its breakdown: model states, gathered, buckets, grads, activations
    at_most_activations: dict[str, int]  # the same breakdown when activations were largest
    timeline: list[dict[str, int]]  # the breakdown after every op that changed the live total
    peak_by_device: dict[str, int]
    nvme: int = 0  # swap-file bytes
    rounding: int = 0  # CUDA allocator rounding of the held tensors (0 on CPU)
    comm_scratch: int = 0  # gloo: the largest all-gather scratch (not in the peak; see PlanComm)


class FrozenSafeMemTracker(MemTracker):
    """MemTracker for models with frozen parameters. Its module pre-hook registers a gradient hook
    on every parameter of the module (to label gradients), which torch refuses on one that does not
    require a gradient: estimating a LoRA model raised 'cannot register a hook on a tensor that
    doesn't require gradient'. Such modules get no gradient hooks: their gradients' bytes are
    still counted as the storages they are (only the label is lost; the planner's breakdown comes
    from the dry engine anyway)."""

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
        install = install_grad_hooks and all(p.requires_grad for p in module.parameters())
        return super()._track_module_params_and_buffers(module, install_grad_hooks=install)


class _PeakTracker(FrozenSafeMemTracker):
    """MemTracker that hands the live total to ``on_op`` after every op that changed it."""

    def __init__(self, on_op):
        super().__init__()
        self._on_op = on_op
        self._last = -1

    def restart_peak(self) -> None:
        self._peak_mem = {d: s[_TOTAL] for d, s in self._curr_mem_snap.items()}

    def _total(self) -> int:
        return sum(s.get(_TOTAL, 0) for s in self._curr_mem_snap.values())

    def _update_peak_stats(self, peak_state) -> None:
        # the per-module peaks of the parent class are not used: only the global one
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap[_TOTAL]:
                self._peak_mem[dev] = snap[_TOTAL]
        total = self._total()
        if total != self._last:
            self._last = total
            self._on_op(total)


def _grads_in_flight(engine: DryEngine) -> int:
    """Bytes of ``.grad`` tensors autograd made that the engine's buffers do not hold yet."""
    seen, n = set(), 0
    for g in engine.groups:
        views = {id(v) for v in g.grad_views}
        for p in g.params:
            gr = p.grad
            if gr is None or id(gr) in views:
                continue
            st = gr.untyped_storage()
            if st._cdata not in seen:
                seen.add(st._cdata)
                n += st.nbytes()
    return n


def trace_step(engine: DryEngine, run_forward, steps: int = 2) -> StepMemory:
    """Runs ``steps`` training steps (stage 3 needs a second one: the first records the order its
    prefetch follows) and measures the last. ``run_forward(module) -> loss`` makes its own inputs."""
    for _ in range(steps - 1):
        _one_step(engine, run_forward)
    between = engine.held()
    nvme, rounding = engine.nvme_bytes(), engine.rounding(512)
    peak: dict[str, int] = {"total": -1}
    most_act: dict[str, int] = {"activations": -1}
    timeline: list[dict[str, int]] = []

    def on_op(total: int) -> None:
        held = engine.held()
        transient = held["gathered"] + held["staged"] + held["buckets"]
        states = held["total"] + held["host_total"] - transient
        grads = _grads_in_flight(engine)
        act = total - states - transient - grads
        now = dict(model_states=states, gathered=held["gathered"] + held["staged"], buckets=held["buckets"],
                   grads_in_flight=grads, activations=act)
        timeline.append(now)
        if total > peak["total"] or act > most_act["activations"]:
            if total > peak["total"]:
                peak.clear()
                peak.update(now, total=total)
            if act > most_act["activations"]:
                most_act.clear()
                most_act.update(now)

    tracker = _PeakTracker(on_op)
    tracker.track_external(*engine.tensors(), *engine.reducer.bucket_tensors())
    with tracker, warnings.catch_warnings():
        # MemTracker's module hooks look at parameters' .grad, which is None before backward: it warns
        warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
        tracker.restart_peak()
        on_op(tracker._total())
        _one_step(engine, run_forward)
    peak_by_device = {str(d): int(v) for d, v in tracker._peak_mem.items()}
    total = peak.pop("total")
    return StepMemory(between=between, peak=total, at_peak=peak, peak_by_device=peak_by_device,
                      at_most_activations=most_act, timeline=timeline, nvme=nvme, rounding=rounding, comm_scratch=engine.comm.scratch)


def _one_step(engine: DryEngine, run_forward) -> None:
    """Engine.forward / backward / step as they touch memory (the Adam kernels work in place)."""
    loss = run_forward(engine.module)
    if engine.gatherer is not None:
        engine.gatherer.begin_backward()
    engine.reducer.begin_backward(True)
    loss.float().backward()
    del loss
    engine.reducer.finish_backward()
    if engine.gatherer is not None:
        engine.gatherer.end_backward()
        engine.gatherer.free_all()
    _step_gathers(engine)
    engine.reducer.clear()
    if engine.offload is not None and engine.offload.queued:
        # OffloadPlan.launch: the next forward's first gather of each host-stepped unit is deferred
        # until the unit is waited for (then issued synchronously)
        for g in engine.groups:
            if g.offload is not None and g.offload.queued:
                g.defer_next_gather()


def _step_gathers(engine: DryEngine) -> None:
    """Stages 1/2 over several ranks: after its update each group is all-gathered, at most
    ``allgather_bucket_size`` elements in flight (Engine._update); on gloo each holds a scratch."""
    z = engine.config.zero_optimization
    if z.stage not in (1, 2) or engine.comm.world == 1:
        return
    cap, inflight, elems = z.allgather_bucket_size, [], 0
    for g in engine.groups:
        while inflight and elems + g.layout.padded > cap:
            h, n = inflight.pop(0)
            h.wait()
            elems -= n
        inflight.append((engine.comm.all_gather(g.param_flat, async_op=True), g.layout.padded))
        elems += g.layout.padded
    for h, _ in inflight:
        h.wait()
