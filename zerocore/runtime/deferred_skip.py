"""bf16's Inf/NaN check (``bf16.check_grad_overflow``, DeepSpeed's default) with no host wait in the step.

DeepSpeed's rule: an accumulation boundary whose gradients hold Inf/NaN skips its update, counts in
``skipped_steps``, and does not step the engine's lr schedule. Deciding that on the host costs a
device-to-host read of the overflow flag in every step: a stream synchronisation, which in a
host-bound step (a 256M Llama on an H100: the GPU busy 20 of ~50 ms) made stage 2 1.11x torch AMP
against 0.96x without the read (benchmarks/results/gpu_h100_2026-11-26_issue35).

So the decision is made on the device and read by the host later:

- the coefficient the Adam kernels read (the clip coefficient, ``grad_norm.clip_coef``) becomes NaN
  when the gradients hold Inf/NaN (``skip_coef``); the kernels then leave every parameter, moment and
  16-bit copy as it was (``csrc/cuda/adam.cu``; ``ops.adam_step_multi`` on the CPU): the update is
  skipped where it would have been applied;
- the host counts the step as applied (``optimizer_steps``, the lr schedule stepped) and keeps what it
  needs to take that back (``PendingSkip``): the flag, copied to host memory behind an event as soon as
  it is computed, and the schedule's state and the groups' values from before its step;
- the engine reads the flag when the host next needs the truth (``Engine._settle_skip``): at the next
  ``step()`` (the flag was computed during the last one: its event is complete, nothing waits), or when
  asked (``overflow``, ``skipped_steps``, ``optimizer_steps``: a checkpoint, a trainer's question). A
  skipped step is then taken back: ``optimizer_steps`` - 1, ``skipped_steps`` + 1, ``overflow`` set, the
  schedule and the groups' values restored, the warning said.

What a user can see: between a skipped step and its settling, the lr schedule already moved on the host
(read from the schedule object itself, e.g. by a logger); no update ever reads that value. A group value
set in between (``engine.lr = x``, a write into ``param_groups``) is kept when the step is taken back. A schedule
that cannot be copied (its ``state_dict`` refuses ``copy.deepcopy``) is not stepped on faith: the flag
is read at once (one wait, as before). The engine uses this only where every update reads the device
coefficient (zerocore's Adam kernels; not a client torch optimizer, not CPU offload, whose norms are
host values already) and never with fp16 (its loss scale needs the decision: one read per boundary,
as torch's GradScaler).
"""
from __future__ import annotations

import copy
import warnings

import torch

from ..offload.host_memory import host_empty


def skip_coef(total: torch.Tensor, coef: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``coef``, or NaN where the gradients hold Inf/NaN; the flag). ``total``: ``grad_sumsq``'s
    [sum of squares, count of tensors with Inf/NaN] over every rank; the eager check's condition
    (a count > 0 or a non-finite sum)."""
    bad = (total[1] > 0) | ~torch.isfinite(total[0])
    return torch.where(bad, torch.full_like(coef, float("nan")), coef), bad


class PendingSkip:
    """One boundary's Inf/NaN decision, made on the device and not yet read by the host."""

    __slots__ = ("step", "_flag", "_event", "_schedule")

    def __init__(self, bad: torch.Tensor, step: int):
        self.step = step  # the global step whose update it decides (named by the warning)
        cuda = bad.device.type == "cuda"
        # on CUDA a pinned buffer the copy lands in behind an event; on the CPU the same code
        # (non_blocking changes nothing there), so zerocore.debug.host_waits meets what a GPU runs
        self._flag = host_empty(1, torch.bool, cuda)
        self._flag.copy_(bad.reshape(1), non_blocking=True)
        self._event = None
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(bad.device))  # the stream the copy went on
        self._schedule = None

    def keep_schedule(self, schedule, optimizer) -> bool:
        """Saves what the schedule's step is about to change (its state, the groups' values); False
        when its state cannot be copied (the caller then reads the decision at once)."""
        try:
            state = copy.deepcopy(schedule.state_dict())
        except Exception:  # noqa: BLE001 - any schedule's state: a copy we cannot make means no undo
            return False
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self._schedule = (schedule, state, optimizer, groups, None)
        return True

    def schedule_stepped(self) -> None:
        """Notes the groups' values the schedule's step left (``restore_schedule`` puts back only those
        still as it left them: a value set since, e.g. ``engine.lr = x``, is kept)."""
        if self._schedule is not None:
            schedule, state, optimizer, before, _ = self._schedule
            after = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            self._schedule = (schedule, state, optimizer, before, after)

    def skipped(self) -> bool:
        """The decision. Waits only when the device has not computed it yet (an event wait)."""
        if self._event is not None:
            if not self._event.query():
                self._event.synchronize()
            self._event = None
        return bool(self._flag[0])

    def restore_schedule(self) -> None:
        """Puts the schedule and the groups' values back as they were before the skipped step's
        schedule step (DeepSpeed does not step the schedule on a skipped update)."""
        if self._schedule is None:
            return
        schedule, state, optimizer, before, after = self._schedule
        self._schedule = None
        schedule.load_state_dict(state)
        for i, (g, saved) in enumerate(zip(optimizer.param_groups, before)):
            left = after[i] if after is not None and i < len(after) else {}
            for k, v in saved.items():
                if k not in left or _same(g.get(k), left[k]):
                    g[k] = v


def _same(a, b) -> bool:
    """Whether a group value is still the one the schedule's step left (tensors by identity)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value that does not compare: taken as changed, kept
        return False


def settle(engine) -> None:
    """Reads ``engine``'s pending decision, if any; a skipped update is taken back from the host's counts
    (optimizer_steps - 1, skipped_steps + 1, overflow set) and the lr schedule, and said in a warning."""
    pending = engine.__dict__.get("_pending_skip")
    if pending is None:
        return
    engine._pending_skip = None
    if not pending.skipped():
        return
    d = engine.__dict__
    d["_optimizer_steps"] -= 1
    d["_skipped_steps"] += 1
    d["_overflow"] = True
    pending.restore_schedule()
    warnings.warn(f"zerocore: Inf/NaN in the gradients at step {pending.step}; the update was skipped",
                  RuntimeWarning, stacklevel=4)


class SettledCount:
    """An engine attribute a pending decision may still change (``optimizer_steps``, ``skipped_steps``,
    ``overflow``), kept in ``_<name>``: read or set, the decision is settled first. After ``destroy()`` a
    name whose ``_<name>`` was not kept (runtime/release._KEPT) raises EngineDestroyed, as any other."""

    def __init__(self, doc: str):
        self.__doc__ = doc

    def __set_name__(self, owner, name: str) -> None:
        self.field = "_" + name

    def __get__(self, engine, owner=None):
        if engine is None:
            return self
        if engine.__dict__.get("_pending_skip") is not None:
            settle(engine)
        return getattr(engine, self.field)

    def __set__(self, engine, value) -> None:
        settle(engine)
        engine.__dict__[self.field] = value

