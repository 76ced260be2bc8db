"""Checks of what users hand the engine, each raising an error that says what they did and
what to do instead (rather than a failure deep inside, or a silently wrong step)."""
from __future__ import annotations

import functools
import math
import re
from itertools import filterfalse
from operator import attrgetter
import time
import warnings
import weakref

import torch

from ..comm.divergence import DivergenceError
from ..comm.group import record_failure, recorded_failures

# _window_start: where the accumulation window began (deepspeed_methods.py), moved at the boundary
_COUNTERS = ("micro_steps", "global_steps", "optimizer_steps", "skipped_steps", "_window_start")


def checked_lr(value) -> float:
    """``engine.lr = value``: a finite number >= 0 (a NaN there would reach Adam and poison
    every parameter at the next step)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"zerocore: engine.lr must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"zerocore: engine.lr must be a finite number >= 0, got {value!r}; the learning rate was "
                         "not changed")
    return value


def keeps_counters_on_failure(step):
    """A step that raises leaves the engine's step counters as they were, so a retried or the
    next update runs with Adam's step count right (the counters are advanced before the update
    inside ``step``; this undoes that when it fails)."""

    @functools.wraps(step)
    def wrapper(self, *args, **kwargs):
        saved = [getattr(self, c) for c in _COUNTERS]
        try:
            return step(self, *args, **kwargs)
        except BaseException:
            for c, v in zip(_COUNTERS, saved):
                setattr(self, c, v)
            raise

    return wrapper


def check_loss(loss) -> None:
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"zerocore: engine.backward(loss) needs the loss tensor of this micro-batch's forward (a "
                        f"scalar connected to the model's outputs), got {type(loss).__name__} {loss!r}")
    if loss.numel() != 1:
        raise ValueError(f"zerocore: engine.backward(loss) needs a scalar loss, got a tensor of shape "
                         f"{tuple(loss.shape)}; reduce it first (e.g. loss.mean())")
    if not loss.requires_grad:
        raise ValueError("zerocore: engine.backward(loss): the loss does not require grad (it was computed under "
                         "torch.no_grad(), detached, or from frozen parameters only), so no gradient would reach "
                         "the model")


def upcast_from(trainable, dtype: torch.dtype) -> torch.dtype | None:
    """The 16-bit dtype of a model the config trains in float32 (neither ``fp16.enabled`` nor
    ``bf16.enabled``), after a warning that the engine upcasts it; None otherwise. Not an error: an
    fp16 checkpoint trained in fp32 with fp32 inputs is a sound choice; what goes wrong is feeding it
    16-bit inputs, which the forward then explains (``explain_dtype_error``)."""
    if dtype != torch.float32:
        return None
    low = next((p.dtype for _, p in trainable if p.dtype in (torch.float16, torch.bfloat16)), None)
    if low is not None:
        name = str(low).replace("torch.", "")
        key = "bf16.enabled" if low == torch.bfloat16 else "fp16.enabled"
        warnings.warn(f"zerocore: the model's parameters are {name} and the config enables neither fp16 nor bf16: "
                      f"the engine trains them in float32 (upcast; forward inputs must be float32). Set {key}: "
                      f"true to train in {name}", UserWarning, stacklevel=4)
    return low


def explain_dtype_error(error: RuntimeError, args, kwargs, dtype: torch.dtype,
                        upcast: torch.dtype | None = None) -> RuntimeError | None:
    """When a forward failed on a dtype mismatch and an input is floating point of another dtype
    than the engine holds the model in, the error that says so (None: not that case); ``upcast``:
    the 16-bit dtype the model had before the engine upcast it to float32."""
    text = str(error)
    if "dtype" not in text and "type" not in text:
        return None
    inputs = list(args) + list(kwargs.values())
    wrong = [(i, t.dtype) for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.is_floating_point()
             and t.dtype != dtype]
    if not wrong:
        return None
    i, got = wrong[0]
    name = lambda d: str(d).replace("torch.", "")  # noqa: E731
    why = ""
    if upcast is not None:
        key = "bf16.enabled" if upcast == torch.bfloat16 else "fp16.enabled"
        why = (f" (the model was {name(upcast)}: with neither fp16.enabled nor bf16.enabled in the config the engine "
               f"upcast it to float32; set {key}: true to train in {name(upcast)})")
    return RuntimeError(f"zerocore: the engine holds the model in {name(dtype)}{why} and input #{i} of the forward is "
                        f"{name(got)}; cast floating inputs to {name(dtype)} (x.to({dtype})) as DeepSpeed requires. "
                        f"({type(error).__name__}: {text})")


# A shape or size of 0 in a forward's error message: "(0)", "[0]", "(0,)", "2x0", "0x8", "size 0"
_EMPTY_IN_MESSAGE = re.compile(r"\(0\)|\[0\]|\(0,\)|\dx0\b|\b0x\d|\bsize 0\b")
EMPTY_PARAMETER_NOTE = (
    "zerocore: at stage 3 a parameter is an empty tensor (shape (0,)) outside its unit's forward. A forward reads "
    "another module's parameter whole when it reads it through its owner (self.other.weight) or when the owner "
    "returned it; one kept elsewhere (a list, a closure) must be declared: zerocore.register_external_parameter("
    "module_that_uses_it, parameter) (DeepSpeed's deepspeed.zero.register_external_parameter). "
    "`with zerocore.debug.partitioned_reads(raise_on_read=True):` around the forward names the parameter and the call.")


def note_empty_parameter(error: RuntimeError) -> None:
    """A stage-3 forward failed with a size of 0 in its message: most likely a partitioned parameter used where it
    holds no values; a note (shown under the traceback) says how that happens and what names it. The error itself
    is unchanged (a note, not a new exception: the message may have another cause)."""
    if _EMPTY_IN_MESSAGE.search(str(error)) and hasattr(error, "add_note"):
        error.add_note(EMPTY_PARAMETER_NOTE)


class NoSyncMisuse(RuntimeError, AssertionError):
    """``no_sync()`` misused (at stages 2/3, nested, ``step()`` inside it). An AssertionError too:
    DeepSpeed asserts there, and its scripts and tests catch AssertionError; the messages carry
    DeepSpeed's wording as well as zerocore's."""


class CollectiveTimeout(RuntimeError):
    """A collective waited past the process group's timeout: another rank stopped issuing them."""


def _is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    if isinstance(e, DivergenceError):
        return " waited " in text
    return isinstance(e, RuntimeError) and ("timed out" in text or "application timeout" in text)


def reports_stalls(method):
    """For engine.forward/backward/step on several ranks: an exception raised here is left in
    the store for the other ranks; a collective that timed out (the process group's timeout,
    or stage 3's divergence timeout) is re-raised naming the ranks that recorded a failure at
    this micro-step, i.e. the ranks that stopped issuing collectives and why."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as e:
            tag = getattr(self, "_tag", None)
            if tag is None or self.comm.world == 1:
                raise
            where = f"{method.__name__} of micro-step {self.micro_steps + 1}"
            if not _is_timeout(e) and not isinstance(e, DivergenceError):
                record_failure(self.comm, tag, self.micro_steps, f"{where} raised {type(e).__name__}: {e}")
                raise
            others = _failures_soon(self.comm, tag, self.micro_steps)
            if not _is_timeout(e):  # a divergence: add why a rank diverged, when it said
                if not others:
                    raise
                raise DivergenceError(f"{e}\n" + _who(others)) from e
            who = _who(others) if others else (
                "no other rank recorded an exception in its engine at this micro-step: a rank is blocked elsewhere, "
                "ran fewer micro-batches, or failed outside the engine (e.g. in its loss)")
            if isinstance(e, DivergenceError):
                raise DivergenceError(f"{e}\n{who}") from e
            raise CollectiveTimeout(f"zerocore: rank {self.comm.rank} timed out in a collective during its {where} "
                                    f"({e}). {who}. With a process group of your own, its timeout is "
                                    "init_process_group(timeout=...); when zerocore creates it (torchrun), "
                                    "zero_optimization.comm_timeout") from e

    return wrapper


def _failures_soon(comm, tag: str, micro_step: int, patience_s: float = 2.0) -> dict[int, str]:
    """Failures recorded by the other ranks at ``micro_step``, waiting up to ``patience_s`` for
    one: a rank whose forward raised records it just after the collective that made this rank
    raise (only on this error path)."""
    deadline = time.monotonic() + patience_s
    while True:
        found = recorded_failures(comm, tag, micro_step)
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _who(failures: dict[int, str]) -> str:
    return "; ".join(f"rank {r} stopped issuing collectives: its {text}" for r, text in sorted(failures.items()))


_REQUIRES_GRAD = attrgetter("requires_grad")


class RequiresGradWatch:
    """Which parameters train is fixed at ``initialize`` (the flat groups, the optimizer shards and
    the reducer's bookkeeping are built from it). ``p.requires_grad_(...)`` flipped afterwards
    would leave a "frozen" parameter moving with Adam's momentum, or a newly trainable one never
    trained, silently: ``check`` names the first such parameter at the next ``step()``.

    ``trainable_off_gets_zero_grad`` (set by ``zerocore.deepspeed.initialize``, DeepSpeed's
    behaviour): a trainable parameter whose requires_grad became False is not refused; it gets no
    gradient, i.e. a zero one (Adam still moves it by its momentum and weight decay), with one
    warning naming it. A frozen parameter made trainable is refused either way."""

    trainable_off_gets_zero_grad = False

    def __init__(self, trainable, frozen):
        self.trainable = [p for _, p in trainable]
        self.frozen = [p for _, p in frozen]
        self.names = {id(p): names[0] for names, p in trainable + frozen}
        self._warned: set[int] = set()

    def check(self) -> None:
        # C-level filters: no Python call nor line per parameter, every step
        off = list(filterfalse(_REQUIRES_GRAD, self.trainable))
        on = list(filter(_REQUIRES_GRAD, self.frozen))
        if off and self.trainable_off_gets_zero_grad:
            self._warn_zero_grad(off)
            off = []
        if off or on:
            p, was = (off[0], "trainable") if off else (on[0], "frozen")
            more = len(off) + len(on) - 1
            raise RuntimeError(
                f"zerocore: parameter '{self.names[id(p)]}' was {was} at zerocore.initialize and its requires_grad "
                f"is now {p.requires_grad}{f' (and {more} more)' if more else ''}; which parameters train is fixed "
                "when the engine is built. Set requires_grad before zerocore.initialize (engine.destroy() and "
                "initialize again to change it); nothing was updated")

    def _warn_zero_grad(self, off) -> None:
        new = [p for p in off if id(p) not in self._warned]
        if new:
            self._warned.update(id(p) for p in new)
            names = ", ".join(f"'{self.names[id(p)]}'" for p in new)
            warnings.warn(f"zerocore.deepspeed: parameter{'s' if len(new) > 1 else ''} {names} "
                          f"{'were' if len(new) > 1 else 'was'} trainable at initialize and "
                          f"{'have' if len(new) > 1 else 'has'} requires_grad False now: "
                          "trained with a zero gradient (Adam's momentum and weight decay still move "
                          f"{'them' if len(new) > 1 else 'it'}), as DeepSpeed does; warned once per parameter",
                          UserWarning, stacklevel=4)


def own_module_zero_grad(engine) -> None:
    """The engine owns the gradients (DeepSpeed's semantics): ``model.zero_grad()`` on the model it
    wraps is a no-op, with a warning when it lands inside an accumulation window (where it
    would otherwise drop the micro-batches so far at stages 0/1, whose ``.grad`` are views of
    the flat buffer, and change nothing at stages 2/3, whose gradients already left ``.grad``).
    ``engine.zero_grad()`` is the way to discard them. Undone by ``engine.destroy()``, or when the
    engine is freed (the function reaches it weakly: the module is the engine's, not its owner)."""
    module = engine.module
    me = weakref.ref(engine)

    def zero_grad(set_to_none: bool = True) -> None:
        engine = me()
        if engine is None:  # the engine was dropped without destroy(): the module is plain torch again
            give_back_module_zero_grad(module_ref())
            m = module_ref()
            if m is not None:
                m.zero_grad(set_to_none)
            return
        if engine._mid_window():
            warnings.warn("zerocore: model.zero_grad() inside a gradient accumulation window was ignored: the "
                          "engine owns the gradients and clears them itself at each optimizer step (as DeepSpeed "
                          "does); call engine.zero_grad() to discard the micro-batches accumulated so far",
                          RuntimeWarning, stacklevel=2)

    module_ref = weakref.ref(module)  # the function is the module's own attribute: no strong reference to it
    module.__dict__["zero_grad"] = zero_grad  # an instance attribute shadows nn.Module.zero_grad
    weakref.finalize(engine, _drop_override, module_ref, zero_grad)  # an engine dropped without destroy()


def _drop_override(module_ref: weakref.ref, fn) -> None:
    m = module_ref()
    if m is not None and m.__dict__.get("zero_grad") is fn:  # not a later engine's
        del m.__dict__["zero_grad"]


def give_back_module_zero_grad(module) -> None:
    if module is not None:
        module.__dict__.pop("zero_grad", None)
