"""Where the owned optimizer shard and the stage-3 parameter shards rest (the engine's one
placement decision, made here from the config's offload sections), and the hooks that move bytes
there.

- ``make_shard``: the group's optimizer shard on the host (``HostOptimizerShard``) and, with
  parameter offload, its 16-bit shard moved to host memory while ``max_in_cpu`` elements allow,
  else (device 'nvme') to its swap file (``nvme.ParamSwap``: read ahead of its gathers in the
  recorded order, written back behind the host step).
- ``on_reduced(k)`` (the reducer's callback): in the boundary backward, group k's owned gradient
  is final: it goes to the host and its norm/overflow contribution is accumulated, so the global
  norm is known when backward ends (``landed_sumsq``); every group's norm part is computed on the
  device then and read by the host in one copy behind one event (``device_norms.py``).
- ``launch()`` after the engine's step loop: at stage 3 the host steps were only queued; they are
  handed to the worker in the order the last forward gathered the units (the next forward's
  order), and each unit's gather waits for its own (``GroupOffload.ready``). Stages 1/2 step
  synchronously: the all-gather that follows each group's step needs its updated slice, so the
  overlap there is the engine's (group k's all-gather while group k+1 steps); on a GPU each such
  step runs on the worker thread all the same (``_run_now``), with the host's thread count
  (host_threads.py), not the training thread's (one, under torchrun).
"""
from __future__ import annotations

import weakref

import torch

from .._weak import weak_call
from ..config.options import ConfigError
from ..sharding.offloaded import GroupOffload
from ..sharding.optimizer import OptimizerShard
from .host_memory import should_pin
from .host_shard import HostOptimizerShard
from .device_norms import LandedNorm, fetch
from .host_stepped import HostSteppedShard
from .host_threads import host_step_threads, worker_at_stages_1_2
from .nvme import NvmeSwap, ParamReady, ParamSwap
from .nvme.checks import check_nvme_path
from .stepper import HostStepper


def _GONE():
    return None


class OffloadPlan:
    def __init__(self, config, device: torch.device, boundary):
        z = config.zero_optimization
        opt, par = z.offload_optimizer, z.offload_param
        self.optimizer = opt.device in ("cpu", "nvme")
        self.params = par.device in ("cpu", "nvme")
        self.params_device = par.device
        if par.device == "nvme":  # the config's checks are the schema's; the path's are this machine's, now
            check_nvme_path("zero_optimization.offload_param.nvme_path", par.nvme_path)
        self.nvme = NvmeSwap.build(config)  # optimizer state in swap files (zerocore/offload/nvme)
        self._config = config
        self.param_swap: ParamSwap | None = None  # stage-3 parameter shards beyond max_in_cpu (made on first need)
        self.ratio = opt.ratio if self.optimizer else 0.0
        self.pin_opt = should_pin(opt.pin_memory, device) if self.optimizer else False
        self.pin_par = should_pin(par.pin_memory, device) if self.params else False
        self.max_in_cpu = par.max_in_cpu
        self.device = device
        self.boundary = boundary  # () -> is the backward under way the accumulation boundary's
        # stage 3 queues its host steps for the worker (each unit's next gather waits for its own);
        # stages 1/2 step synchronously, on the worker too on a GPU (its own thread count, host_threads.py)
        self.queued = z.stage == 3
        use_worker = self.queued or worker_at_stages_1_2(device)
        self.stepper = HostStepper(host_step_threads(device)) if use_worker else None
        self.shards: dict[int, HostSteppedShard] = {}
        self.host_param_elems = 0
        self.order: list[int] = []  # groups in the order they were first gathered since the last step
        self._seen: set[int] = set()
        self._queued: list[tuple[int, object, object]] = []
        self._resident: dict = {}  # index -> weak reference to a device-resident group (optimizer state there)
        self._resident_norms: dict[int, LandedNorm] = {}  # their norm parts of the boundary under way

    @staticmethod
    def build(config, device: torch.device, boundary) -> "OffloadPlan | None":
        z = config.zero_optimization
        if z.offload_optimizer.device == "none" and z.offload_param.device == "none":
            return None
        return OffloadPlan(config, device, boundary)

    # -- construction ------------------------------------------------------------------------
    def make_shard(self, g, init: torch.Tensor, tile: int | None):
        swapped = False
        if self.params and g.partitioned:
            swapped = self.host_param_elems + (g.hi - g.lo) > self.max_in_cpu and self.params_device == "nvme"
            if not swapped:  # the groups that fit stay in host memory; the rest rest on NVMe
                self.host_param_elems += g.hi - g.lo
            if self.host_param_elems > self.max_in_cpu:
                raise ConfigError(
                    f"zero_optimization.offload_param.max_in_cpu: {self.max_in_cpu} elements cannot hold this rank's "
                    f"parameter shards (at least {self.host_param_elems} elements by group {g.index}) and device 'cpu' "
                    "keeps every shard in host memory. Raise max_in_cpu to at least the model's trainable elements "
                    "divided by the ranks, use offload_param.device 'nvme' (the shards beyond max_in_cpu rest on "
                    "NVMe), or 'none'")
            g.offload_params(self.pin_par)
        if not self.optimizer and not g.params_on_host:
            self._resident[g.index] = weakref.ref(g)  # the engine owns it
            return OptimizerShard(g, init, tile=tile)
        if self.nvme is not None:
            shard = self.nvme.make_shard(g, init, self.pin_opt)
        else:
            shard = HostOptimizerShard(g, init, ratio=self.ratio, pin=self.pin_opt, tile=tile, params_swapped=swapped)
        ready = shard.ready
        if swapped:
            if self.param_swap is None:
                self.param_swap = ParamSwap(self._config)
            same_drive = self.nvme is not None and self.nvme.path == self.param_swap.path
            self.param_swap.register(g, also_needed=self.nvme.needed if same_drive else 0)
            shard.param_swap = self.param_swap
            ready = ParamReady(shard.ready, self.param_swap, g.index)
        queued = self.queued and g.partitioned  # stage 3: host steps queued, gathers noted
        # the group and the shard call back into this plan weakly: the plan holds the shards
        g.attach_offload(GroupOffload(shard, ready, weak_call(self._note_gather) if queued else None, queued=queued))
        if self.stepper is not None:  # a speculative step goes to the worker at once (offload/speculation.py)
            shard.run_later = weak_call(self.stepper.submit)
        if queued:
            shard.enqueue = weak_call(self._enqueue)
        elif self.stepper is not None:
            shard.run_now = weak_call(self._run_now)
        if not self.queued and shard.reads_ahead:  # stages 1/2 step in index order: read the next ahead
            last = max((i for i in self.shards if self.shards[i].reads_ahead), default=None)
            if last is not None:
                self.shards[last].then = shard
        self.shards[g.index] = shard
        if shard.releases_grad:  # its device gradient exists only from a window's first reduction to its landing
            g.release_grad()
        return shard

    def place_frozen(self, g) -> None:
        """A stage-3 group of frozen parameters (no optimizer shard): with parameter offload its
        chunk rests in (pinned) host memory, copied to the device for each all-gather. Device
        'nvme' keeps frozen chunks in host memory too (they are never written: nothing to swap
        back), and they do not count against ``max_in_cpu``, which sizes the trainable shards."""
        if self.params and g.partitioned:
            g.offload_params(self.pin_par)

    # -- gradients ---------------------------------------------------------------------------
    def on_reduced(self, k: int) -> None:
        if not self.boundary():
            return
        self.land(k)
        if self.nvme is not None and not self.queued and k in self.shards and k == min(self.shards):
            # stages 1/2 step synchronously, this group first: its first tiles load during backward
            self.shards[k].read_first_tiles(self.shards[k].last_step + 1)

    def land(self, k: int) -> None:
        """Group k's owned reduced gradient is final: its host copy and norm (a host shard; a speculative step
        from an earlier copy is dropped, by ``HostSteppedShard.land``), or its norm alone (a device-resident
        group: stage 3's persistent ones). At the boundary backward's reduction, and again where the gradient
        was written after it, before the step (a tensor-fragment write: runtime/param_fragments.py)."""
        shard = self.shards.get(k)
        if shard is None:
            g = self._resident.get(k, _GONE)()
            if g is not None:
                self._resident_norms[k] = LandedNorm(g.owned_grad())
            return
        shard.land(shard.group.owned_grad())

    def landed_sumsq(self, groups, shards) -> tuple[float, bool]:
        """(sum of squares, any Inf/NaN) of this rank's owned reduced gradients, group by group in
        index order (the order, hence the bits, of the engine's own sum). No host wait for the device: the
        host waits on the event after the pairs' one copy to the host (``device_norms.fetch``) and on those
        after the landed gradients' copies (a CUDA device)."""
        sumsq, bad = 0.0, False
        norms = {g.index: (shard.pending_norm() if isinstance(shard, HostSteppedShard) else
                           # launched as the group's gradient was reduced (on_reduced), else now
                           self._resident_norms.pop(g.index, None) or LandedNorm(g.owned_grad()))
                 for g, shard in zip(groups, shards)}
        fetch([n for n in norms.values() if n is not None])  # every pair in one copy
        for g, shard in zip(groups, shards):
            if isinstance(shard, HostSteppedShard):
                s, b = shard.landed_sumsq()
            else:
                s, b = norms[g.index].get()
            sumsq += s
            bad = bad or b
        self._resident_norms.clear()
        return sumsq, bad

    # -- the step ----------------------------------------------------------------------------
    def _note_gather(self, gi: int) -> None:
        if self.param_swap is not None:
            self.param_swap.on_gather(gi)
        if gi not in self._seen:
            self._seen.add(gi)
            self.order.append(gi)

    def _enqueue(self, gi: int, fn, ready) -> None:
        ready.clear()  # reads of this group's parameters wait from now on
        self._queued.append((gi, fn, ready))

    def _run_now(self, gi: int, fn, ready) -> None:
        """Stages 1/2 on a GPU: the host step on the worker (its thread count), waited for here; on
        CUDA the current stream then waits for its copy back (``Ready.wait``)."""
        self.stepper.submit(gi, fn, ready)
        ready.wait_own()

    def launch(self) -> None:
        """Hands the queued host steps to the worker, first-needed first."""
        rank = {gi: i for i, gi in enumerate(self.order)}
        self._queued.sort(key=lambda job: (rank.get(job[0], len(rank)), job[0]))
        if self.param_swap is not None:
            self.param_swap.new_pass([job[0] for job in self._queued])
        if not self._queued:
            self.order.clear()
            self._seen.clear()
            return
        if self.nvme is not None:  # each swapped shard's pass reads the next one's first tile (NvmeOptimizerShard)
            steps = [self.shards[job[0]] for job in self._queued]
            for shard, then in zip(steps, steps[1:] + [None]):
                if shard.reads_ahead:
                    shard.then = then if then is not None and then.reads_ahead else None
        for gi, fn, ready in self._queued:
            self.shards[gi].group.defer_next_gather()
            self.stepper.submit(gi, fn, ready)
        self._queued.clear()
        self.order.clear()
        self._seen.clear()

    def close(self) -> None:
        """Stops the host-step worker after its queued steps, closes the NVMe swap stores (I/O
        handles released, this run's swap folders removed)."""
        if self.stepper is not None:
            self.stepper.close()
        if self.nvme is not None:
            self.nvme.close()
        if self.param_swap is not None:
            self.param_swap.close()
