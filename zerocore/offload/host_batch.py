"""Stages 1/2 with CPU offload: the host Adam of several consecutive groups as one job, one native
multi-tensor call (one OpenMP team over all their elements) instead of a job per group.

Why: a group's host step handed to the worker costs a hand-over (two thread wake-ups, the Python of
the step and of its copy back, an OpenMP team woken for one group's elements) that does not depend on
its size. With the reduction bucket as the group size a 337M-parameter GPT has ~150 groups; on an
H100 host its offloaded stage-2 step took 124 ms on the host against 86 ms for the host Adam alone
(benchmarks/results/gpu_h100_2026-11-26_issue35_stop40). A batch pays that once for up to
``HOST_BATCH_ELEMS`` elements; the batches stay small enough that one batch's copies back to the
device (issued on one side stream after its call) run while the next batch computes.

Which shards join (``batchable``): the whole owned range stepped on the host (no twin-flow device
part), state in host memory (not NVMe), zerocore's Adam (not a client torch optimizer, which has its
own step per shard), stepped when the engine asks (stages 1/2; stage 3 queues its steps behind the
next forward, placement.py). The engine groups consecutive ones (``runtime/engine.py::_step_batches``),
at most allgather_bucket_size elements per batch where each batch's all-gathers follow it.
"""
from __future__ import annotations

import dataclasses

import torch

from ..sharding.optimizer import AdamHyper, MultiShardStep
from .host_shard import HostOptimizerShard
from .speculation import BatchSpeculation, can_speculate
from .stepper import Ready

# Elements of one batch: large enough that the hand-over is a small part of the batch's host Adam
# (~32M elements: ~10 ms of host Adam at ~90 GB/s), small enough that the last batch's copy back to the
# device (64 MB of bf16 at ~25 GB/s: ~3 ms), which nothing overlaps, stays short.
HOST_BATCH_ELEMS = 32 * 2 ** 20


def batchable(shard) -> bool:
    """Whether ``shard``'s step may run inside a HostStepBatch (see the module's docstring)."""
    return (type(shard) is HostOptimizerShard and shard.split == shard.group.hi - shard.group.lo
            and shard.param_swap is None and shard.kernel is None and shard.enqueue is None)


class HostRuns:
    """Collects consecutive ``batchable`` shards (engine group indices, in order) into
    ``(HostStepBatch, indices)`` entries appended to ``batches``, each at most ``cap`` elements
    (a single larger group makes a batch of its own); ``close`` ends the run under way."""

    def __init__(self, batches: list, cap: int):
        self.batches, self.cap = batches, cap
        self.shards: list[HostOptimizerShard] = []
        self.index: list[int] = []
        self.elems = 0

    def add(self, i: int, shard: HostOptimizerShard, size: int) -> None:
        if self.index and self.elems + size > self.cap:
            self.close()
        self.shards.append(shard)
        self.index.append(i)
        self.elems += size

    def close(self) -> None:
        if self.index:
            self.batches.append((HostStepBatch(self.shards), self.index))
        self.shards, self.index, self.elems = [], [], 0


class _HostPart:
    """A host shard's host-resident state in OptimizerShard's names, for MultiShardStep: fp32 master,
    m, v, and the 16-bit values the kernel writes in the same pass (the staging buffer copied to the
    device, or the parameters themselves where they are host memory; None for fp32 training)."""

    def __init__(self, shard: HostOptimizerShard):
        self.shard = shard
        self._out, self._out_of = None, None

    master = property(lambda self: self.shard.master_h)
    exp_avg = property(lambda self: self.shard.exp_avg_h)
    exp_avg_sq = property(lambda self: self.shard.exp_avg_sq_h)
    pieces = property(lambda self: self.shard.pieces)
    tile = property(lambda self: self.shard.tile)

    @property
    def param_out(self):
        s = self.shard
        if s.out_h is not None or not s.half:
            return s.out_h
        target = s.group.owned_params_raw()  # host-resident parameters (a CPU device): written in place
        if self._out_of != target.data_ptr():  # one view while the parameters stay where they are
            self._out, self._out_of = target[:s.split], target.data_ptr()
        return self._out


class HostStepBatch:
    """The host Adam of ``shards`` (consecutive, each ``batchable``) as one job; MultiShardStep's place
    in the engine's step batches. ``step`` returns when every shard's update is in its host state and
    its copy back is queued; the current device stream waits for those copies (not the host)."""

    def __init__(self, shards: list[HostOptimizerShard]):
        self.shards = shards
        self._multi = MultiShardStep([_HostPart(s) for s in shards], list(range(len(shards))))
        self.ready = Ready()  # the job's, on the worker (each shard's own stays set: nothing is queued)
        self.speculation = None  # a BatchSpeculation (offload/speculation.py), when the config asks for one

    def speculate(self, guess) -> bool:
        """Starts this batch's host step as its gradients land (offload/speculation.py); ``guess``: the
        engine's speculation._Guess. False where the batch's shards cannot (no worker; an fp32 master
        that is the parameter itself)."""
        if not all(can_speculate(s) for s in self.shards):
            return False
        self.speculation = BatchSpeculation(self.shards, guess, self.shards[0].run_later)
        return True

    def step(self, grads, hp, *, step: int, grad_scale: float) -> None:
        """``grads``: the device gradients (unused: each shard's landed host copy, ``grad_h``, is read).
        ``hp``: an AdamHyper, or one per hyper-parameter group (copied: the worker reads this step's)."""
        hp = dataclasses.replace(hp) if isinstance(hp, AdamHyper) else [dataclasses.replace(h) for h in hp]
        if self.speculation is not None and self.speculation.take(hp, step, grad_scale):
            # the speculative step was this one: its buffers are the state now, only the copies back are left
            ev = _copy_back_all(self.shards, HostOptimizerShard.speculative_src)
            if ev is not None:
                torch.cuda.current_stream().wait_event(ev)
            return
        landed = [s.grad_h for s in self.shards]

        def job():
            for s in self.shards:  # last step's copies back may still read the staging buffers written now
                s.wait_copy_back()
            self._multi.step(landed, hp, step=step, grad_scale=grad_scale)
            return _copy_back_all(self.shards)

        first = self.shards[0]
        if first.run_now is not None:  # a GPU (or ZEROCORE_HOST_STEP_THREADS): on the worker, waited for
            first.run_now(first.group.index, job, self.ready)
            return
        ev = job()
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)


def _own_src(s: HostOptimizerShard):
    return s.out_h if s.half else s.master_h


def _copy_back_all(shards: list[HostOptimizerShard], src_of=_own_src):
    """Every shard's updated values (``src_of``: what HostOptimizerShard's own step copies, the 16-bit
    staging buffer or the fp32 master; a kept speculation's, HostOptimizerShard.speculative_src) into its
    device parameters, on one side stream behind one CUDA event,
    which each shard keeps as its last copy back and which is returned (None where nothing was copied
    or the device is the CPU, where the copies are done when this returns)."""
    stream = shards[0]._stream() if shards[0].group.owned_params_raw().device.type == "cuda" else None
    copied = [s for s in shards
              if s._queue_copy_back(s.group.owned_params_raw()[:s.split], src_of(s), stream)]
    if not copied:
        return None
    ev = torch.cuda.Event()
    ev.record(stream)
    for s in copied:
        s._copy_event = ev
    return ev
