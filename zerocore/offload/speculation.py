"""CPU offload: the host Adam of a batch of groups (stage 3: of a unit) started as soon as their gradients
have landed, during the backward, before the step knows whether it may use it (a speculative step);
``step()`` then keeps it or drops it, so the result is the same bits as the step taken afterwards.

Why: the host Adam is the offloaded step's largest part (86 ms of a 209 ms step for a 337M GPT on an
H100's host, benchmarks/results/gpu_h100_2026-11-26_issue35), and nothing else runs while it does:
the global gradient norm (clipping) and the Inf/NaN check decide the update only once the backward
has ended. DeepSpeed's SuperOffload starts the host step early only without clipping and undoes an
overflowed one arithmetically (rounding: not the same bits). Here the step is out of place: each
shard has a second set of host state buffers (``HostOptimizerShard.make_spare``), the speculative Adam
reads the current master, m and v and writes the other ones (one pass, the same memory traffic as in
place: ``ops.adam_step_multi(sources=)``), and its 16-bit values go to an output buffer, not to the
parameters. The update is kept when it is the one the step asks for: the clip coefficient did not bite,
nothing overflowed, and the hyper-parameters and step count are those read when the batch's last
gradient landed. Then the buffers swap and the 16-bit values go to the parameters (stages 1/2: the
copies back, queued by ``step()``; stage 3: the unit's queued step, on the worker behind the next
forward's gather order, where a host-resident parameter shard swaps with the output buffer too).
Otherwise the second buffers are simply not used and the step runs as without speculation (the jobs
still queued for the same step skip their work).

Costs: 12 bytes per owned parameter of host memory (the second master, m, v; 2 more where the step
otherwise writes host-resident parameters in place), and, when the guess is wrong, host work done for
nothing during the backward (the host's memory bandwidth: on a 2-core CPU device the step was 1.06-1.09x
the step without speculation, benchmarks/offload_speculation.py). So whether to speculate follows the
recent steps (``_Guess.worth_it``: a 2-bit counter of whether the guess held, kept whether or not it
speculated): where clipping bites step after step it stops, and it comes back once guesses hold again.

Config: ``zero_optimization.offload_optimizer.speculative_step`` (off by default; DeepSpeed's
``super_offload`` is read as it). Applies where a worker thread steps the host shards (a GPU, stage 3,
or ZEROCORE_HOST_STEP_THREADS on a CPU device), with zerocore's Adam, ratio 1, parameter shards not on
NVMe, and not fp32 with host-resident parameters (the master is the parameter there). Anything that
writes the current state while a speculation is under way (a checkpoint load) drops it.
"""
from __future__ import annotations

import dataclasses
import threading
import warnings
import weakref
from typing import Callable

from ..config.options import ConfigError
from ..sharding.optimizer import MultiShardStep
from .stepper import Ready


# Elements of one host batch when the batches speculate: each starts once its last gradient has landed, so
# the smaller the batches the earlier the first starts and the shorter the tail left after the backward (the
# batch whose gradients land last; a hand-over costs ~0.3 ms on a GPU's host, which the backward hides).
SPECULATIVE_BATCH_ELEMS = 8 * 2 ** 20


def host_batch_elems(config, default: int) -> int:
    """The host batches' size cap: ``default`` (host_batch.HOST_BATCH_ELEMS), smaller with speculation."""
    return SPECULATIVE_BATCH_ELEMS if config.zero_optimization.offload_optimizer.speculative_step else default


def can_speculate(shard) -> bool:
    """Whether ``shard`` (batchable, or stage 3's queued shard) may take part: a worker steps it, and
    its master is not the parameter itself (fp32 with the parameters in host memory: the speculation
    would write the parameter in use)."""
    return shard.run_later is not None and not shard.master_is_param  # (run_later: set where a worker is)


def queued_alone(shard) -> bool:
    """Stage 3's unit shards: their host step is queued behind the next forward (``enqueue``), with the
    whole owned range on the host, zerocore's Adam and the parameter shard not on NVMe."""
    from .host_shard import HostOptimizerShard

    return (type(shard) is HostOptimizerShard and shard.enqueue is not None and shard.kernel is None
            and shard.split == shard.group.hi - shard.group.lo and shard.param_swap is None)


def plans_spare(config, shard) -> bool:
    """For the planner's dry run (no worker, no engine): whether the engine would give ``shard`` the
    speculation's second state (``HostOptimizerShard.make_spare``), by the rules of ``attach`` and
    ``can_speculate``."""
    from .host_batch import batchable

    opt = config.zero_optimization.offload_optimizer
    return (bool(opt.speculative_step) and opt.device == "cpu" and (batchable(shard) or queued_alone(shard))
            and can_speculate(shard))


class _SpecPart:
    """A shard's state as the speculative step sees it, for MultiShardStep: reads the current buffers
    (``sources``), writes the other ones (``master``/``exp_avg``/``exp_avg_sq``); ``parity``: which of
    the shard's two buffer sets is current (fixed per part, so MultiShardStep's plan stays valid)."""

    def __init__(self, shard, parity: int):
        self.shard, self.parity = shard, parity
        dst, src = shard.state_sets[1 - parity], shard.state_sets[parity]
        self.master, self.exp_avg, self.exp_avg_sq = dst
        self.sources = src

    # read each time: at stage 3 a kept speculation's output becomes the parameter shard and the old shard
    # the next output (HostOptimizerShard.commit_speculation); per parity it is always the same buffer
    param_out = property(lambda self: self.shard.spec_out)
    pieces = property(lambda self: self.shard.pieces)
    tile = property(lambda self: self.shard.tile)


class BatchSpeculation:
    """The speculative host step of one HostStepBatch. ``guess``: the engine's ``_Guess`` (shared by its
    speculations); ``submit``: hands a job to the worker (OffloadPlan._submit)."""

    def __init__(self, shards: list, guess: "_Guess", submit: Callable):
        self.shards = shards
        self.guess, self.submit = guess, submit
        for s in shards:
            s.make_spare()
            s.speculation = self
        self._multi = {p: MultiShardStep([_SpecPart(s, p) for s in shards], list(range(len(shards))))
                       for p in (0, 1)}
        self._landed: set[int] = set()
        self._events: list = []
        self._window = None  # the engine's micro-step the landed set belongs to
        # (its Ready, the (hypers, step, grad_scale) guessed, [True] once it ran, its claim: a Lock taken by the job
        # as it starts, or by ShardSpeculation.queued_step to withdraw a job not started yet)
        self._job: tuple | None = None
        self.kept = self.dropped = self.withdrawn = 0  # counts, for tests and benchmarks

    # -- the backward -------------------------------------------------------------------------
    def before_land(self) -> None:
        """A shard's gradient is about to be overwritten: a speculation still reading the last one
        (a boundary whose step() was never called, or skipped) is waited for and dropped."""
        if self._job is not None:
            self._drop()
        if not self._landed:
            self._events = []

    def landed(self, shard, event) -> None:
        """``shard``'s gradient copy to the host is queued (``event``: its CUDA event, or None); once every
        shard of the batch has landed, the speculative step goes to the worker."""
        window = self.guess.window()
        if window != self._window:  # a new micro-step: what landed in an earlier one (a group that did not land
            self._window = window   # then) must not complete this one's batch with its old gradients
            self._landed.clear()
            self._events = []
        self._landed.add(id(shard))
        if event is not None:
            self._events.append(event)
        if len(self._landed) < len(self.shards):
            return
        self._landed.clear()
        events, self._events = self._events, []
        if not self.guess.worth_it():  # recent guesses were wrong: not this time
            return
        try:
            guess = self.guess()
        except Exception:  # e.g. a hyper-parameter step() itself will refuse, naming it
            guess = None
        if guess is None:
            return
        hypers, step, grad_scale = guess
        multi = self._multi[self.shards[0].current]
        landed = [s.grad_h for s in self.shards]
        shards = self.shards

        guesser = self.guess
        ran = []  # set by the job when it stepped (a cancelled one did not: nothing of it may be kept)
        claim = threading.Lock()

        def job():
            if guesser.cancelled == step:  # an earlier batch found this step's guess wrong
                return
            if not claim.acquire(blocking=False):  # withdrawn by step() before it started (stage 3)
                return
            for ev in events:  # the host waits for the gradient copies on the worker, not the training thread
                ev.synchronize()
            for s in shards:  # a copy back still reading the staging buffer written now
                s.wait_copy_back()
            multi.step(landed, hypers, step=step, grad_scale=grad_scale)
            ran.append(True)

        ready = Ready()
        self._job = (ready, (hypers, step, grad_scale), ran, claim)
        self.submit(shards[0].group.index, job, ready)

    # -- step() ---------------------------------------------------------------------------------
    def _settle_guess(self, hypers, step: int, grad_scale: float):
        """Tells the predictor whether a guess made now would hold, and takes the speculation under way:
        None, or (its Ready, [True] if it ran, whether it is this update, its claim). A wrong guess cancels
        the other jobs still queued for the same step (the other batches guessed the same), before any wait."""
        self.guess.record(step, grad_scale == self.guess.grad_scale())
        if self._job is None:
            return None
        ready, guessed, ran, claim = self._job
        self._job = None
        right = guessed == (hypers, step, grad_scale)
        if not right:
            self.guess.cancelled = guessed[1]
        return ready, ran, right, claim

    def take(self, hypers, step: int, grad_scale: float) -> bool:
        """Whether the speculative step is this update (``hypers``, ``step``, ``grad_scale``: the
        engine's now): then its buffers become the current state (True) and only the copies back are
        left; else it is dropped (False) and the caller steps as without speculation."""
        job = self._settle_guess(hypers, step, grad_scale)
        if job is None:
            return False
        ready, ran, right, _ = job
        error = ready.finish()  # (a failed speculative step: the step taken now raises it, if it is real)
        if not right or error is not None or not ran:
            self.dropped += 1
            return False
        for s in self.shards:
            s.swap_spare()
        self.kept += 1
        return True

    def drop(self) -> None:
        """The current state is about to be written (a checkpoint load): a speculation under way is
        waited for and dropped, and nothing half-landed is started later from the old gradients."""
        self._landed.clear()
        self._events = []
        if self._job is not None:
            self._drop()

    def _drop(self) -> None:
        ready = self._job[0]
        self._job = None
        ready.finish()  # (an error of a step not used is not the training's)
        self.dropped += 1


class ShardSpeculation(BatchSpeculation):
    """Stage 3: one unit shard's speculation. Its step is queued behind the next forward (each unit's
    gather waits for its own), so ``step()`` does not wait for the speculation either: the shard queues
    ``queued_step``'s function instead of its host step, which on the worker (after the speculative job:
    one worker, in submission order) keeps the speculation (swaps the buffers, puts the 16-bit values in
    the parameters: HostOptimizerShard.commit_speculation) or, if the guess was wrong or the speculation
    did not run or failed, takes the host step itself. A speculation the worker has not started by then is
    withdrawn: the unit's own host step is queued instead, in the forward's order."""

    def __init__(self, shard, guess: "_Guess", submit: Callable):
        super().__init__([shard], guess, submit)

    def queued_step(self, hypers, step: int, grad_scale: float, host_step: Callable) -> Callable:
        """What to queue for this step (``host_step``: the shard's own host step)."""
        job = self._settle_guess(hypers, step, grad_scale)
        if job is None:
            return host_step
        ready, ran, right, claim = job
        if right and claim.acquire(blocking=False):  # (a wrong guess: cancelled above, counted as dropped below)
            # Not started yet: withdrawn, and the unit steps in the next forward's order as without speculation.
            # The units whose gradients land last in the backward are the ones the forward needs first; their
            # speculations, still queued on the worker, would run before any unit's step (one worker, in
            # submission order) and hold the whole forward back for all of them, where the host Adam is slower
            # than the backward. (The job sees the claim taken and returns at once.)
            self.withdrawn += 1
            return host_step
        shard = self.shards[0]

        def keep_or_step():
            error = ready.finish()
            if not right or error is not None or not ran:
                self.dropped += 1
                return host_step()
            shard.swap_spare()
            self.kept += 1
            return shard.commit_speculation()
        return keep_or_step


def attach(engine, batches: list) -> list:
    """Sets up ``offload_optimizer.speculative_step`` on the engine's host batches (HostStepBatch
    entries of ``Engine._step_batches``) and stage 3's unit shards; returns the speculations, which the
    engine keeps (the shards reach theirs weakly). Refuses the configurations it cannot serve, naming
    the key."""
    from .host_batch import HostStepBatch  # (host_batch imports this module)

    z = engine.config.zero_optimization
    if not z.offload_optimizer.speculative_step:
        return []
    key = "zero_optimization.offload_optimizer.speculative_step (DeepSpeed: super_offload)"
    if z.offload_optimizer.device != "cpu":
        raise ConfigError(f"{key}: needs offload_optimizer.device 'cpu' (got '{z.offload_optimizer.device}'): the "
                          "NVMe path swaps the state tile by tile and keeps no second copy")
    if engine.offload.param_swap is not None:
        raise ConfigError(f"{key}: not with offload_param.device 'nvme' where parameter shards rest on NVMe "
                          "(each is swapped in for its own step; the speculation would need it during the backward)")
    guess = _Guess(engine)
    out = [multi.speculation for multi, _ in batches if isinstance(multi, HostStepBatch) and multi.speculate(guess)]
    out += [ShardSpeculation(shard, guess, shard.run_later) for shard in engine.shards  # stage 3's units
            if queued_alone(shard) and can_speculate(shard)]
    if not out:
        warnings.warn(f"zerocore: {key} is set but no host step can start early here: it needs the host step on "
                      "a worker thread (a GPU, or ZEROCORE_HOST_STEP_THREADS on a CPU device), zerocore's Adam "
                      "(not a client torch optimizer), ratio 1 and, with fp32, parameters not in host memory (on a "
                      "CPU device or with offload_param the fp32 master is the parameter itself)", stacklevel=3)
    return out


class _Guess:
    """() -> (hypers, step, grad_scale) of the engine's next update if clipping does not bite and no
    gradient overflows: what Engine.step computes then (the same expressions, so the same bits). Holds
    the engine weakly (the batches it serves belong to the engine)."""

    def __init__(self, engine):
        self._engine = weakref.ref(engine)
        self.cancelled = None  # the step whose guess a batch found wrong (its other batches' jobs skip their work)
        self.confidence = 3  # see worth_it
        self._recorded = None

    def __call__(self):
        e = self._engine()
        if e is None:
            return None
        hypers = [dataclasses.replace(h) for h in e.optimizer.hypers()]
        return hypers, e._optimizer_steps + 1, self.grad_scale()

    def grad_scale(self) -> float | None:
        """1 / (world x loss scale): Engine.step's coefficient where the clip does not bite (its expression)."""
        e = self._engine()
        return None if e is None else 1.0 / (e.comm.world * e.scaler.scale)

    # A 2-bit saturating counter of whether the guess held (the clip coefficient did not bite, nothing
    # overflowed), updated every step whether it speculated or not: where clipping bites step after step (early
    # training) the speculation stops costing host memory bandwidth and comes back once the guesses hold again.
    def worth_it(self) -> bool:
        return self.confidence >= 2

    def record(self, step: int, held: bool) -> None:
        if step == self._recorded:  # once per step (every batch reports it)
            return
        self._recorded = step
        self.confidence = min(3, self.confidence + 1) if held else max(0, self.confidence - 2)

    def window(self):
        """The engine's micro-step count: the same from a backward to its step()."""
        e = self._engine()
        return None if e is None else e.micro_steps
