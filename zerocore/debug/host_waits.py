"""Every place the host waits for the device, counted (or raised on) with its call site.

    with zerocore.debug.host_waits() as log:     # raise_on_wait=True: raise at the first wait
        loss = engine(x); engine.backward(loss); engine.step()
    print(log.count, log)                        # each wait: kind, what, file:line

What counts as a host wait (``HostWait.kind``):

- ``item``: ``.item()`` / ``float()`` / ``int()`` / ``bool()`` / ``if t:`` of a device tensor
  (``aten._local_scalar_dense``), and ``.tolist()`` of one;
- ``copy``: a copy from a device tensor into host memory without ``non_blocking``
  (``aten._to_copy`` to the CPU from a non-CPU tensor, ``aten.copy_`` into a host tensor);
- ``sync``: ``torch.cuda.synchronize()``, ``torch.cuda.Stream.synchronize()``;
- ``native``: a zerocore native call returning a host value computed from device data
  (``zerocore.ops.sum_squares`` / ``sum_squares_multi`` unless called with ``sync=False``);
- ``event``: ``torch.cuda.Event.synchronize()`` / ``.query()`` / ``.elapsed_time()``: a wait for
  one piece of recorded work, not for the device. Listed, but not in ``count`` (the offloaded host
  step waits on the event recorded after its gradient's device-to-host copy, by design);
  ``raise_on_events=True`` raises on them too.

Only the thread that entered the context is watched (the offload worker's waits are its own).
"The device" is every non-CPU tensor; with ``device="cpu"`` (what the engine's own debug mode
passes for a CPU engine, and what the tests use) CPU tensors count as device tensors too, except
host buffers allocated through :func:`mark_host` (offload's host memory): a CPU engine's
``.item()`` of its own tensors is exactly where the same engine on a GPU would wait.

The engine reads ``ZEROCORE_DEBUG_HOST_WAITS=count|raise`` at construction and then keeps, per
accumulation window, the waits of its ``forward``/``backward``/``step`` in
``engine.host_waits_last_step`` (``zerocore/debug/engine_waits.py``).

Off (no context entered) this costs nothing: the dispatch mode and the wrappers are installed on
entry and removed on exit; what stays is :func:`mark_host` at host-buffer allocation and
:func:`device_read` (one branch) where a CPU kernel takes a scalar that a CUDA kernel reads from
device memory itself.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import sys
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
# frames a call site is never in: torch, this package, contextlib; and the ops whose own reads are the native
# call's (the site is their caller)
_SKIP_PREFIXES = (_TORCH_DIR, _HERE, contextlib.__file__)
_SKIP_SUFFIXES = (os.path.join("zerocore", "ops", "norm.py"), os.path.join("zerocore", "ops", "cuda", "kernels.py"))

_local = threading.local()  # .exempt: nesting of reads not to count; .watchers: active watchers
_host: dict[int, weakref.ref] = {}  # host-buffer storage address -> a tensor holding it
_lock = threading.Lock()
_installed = 0  # contexts open (any thread): the wrappers are in place while > 0
_saved: list[tuple[object, str, object]] = []
_INHERITED = object()  # a class attribute that was its base's: deleted again on exit


@dataclasses.dataclass(frozen=True)
class HostWait:
    kind: str  # item | copy | sync | native | event
    what: str  # the op or function
    site: str  # "file:line in function": the first frame outside torch

    def __str__(self) -> str:
        return f"{self.kind}: {self.what} at {self.site}"


class HostWaitError(RuntimeError):
    """Raised at a host wait inside ``host_waits(raise_on_wait=True)``."""


@dataclasses.dataclass
class HostWaitLog:
    waits: list[HostWait] = dataclasses.field(default_factory=list)

    @property
    def count(self) -> int:
        """Host waits for the device (event waits not included: see :attr:`events`)."""
        return sum(w.kind != "event" for w in self.waits)

    @property
    def events(self) -> list[HostWait]:
        return [w for w in self.waits if w.kind == "event"]

    def by_site(self) -> collections.Counter:
        return collections.Counter((w.kind, w.what, w.site) for w in self.waits)

    def __len__(self) -> int:
        return self.count

    def __str__(self) -> str:
        lines = [f"{self.count} host wait(s), {len(self.events)} event wait(s)"]
        lines += [f"  {n} x {kind}: {what} at {site}" for (kind, what, site), n in self.by_site().items()]
        return "\n".join(lines)


def mark_host(t: torch.Tensor) -> torch.Tensor:
    """Records ``t``'s memory as a host buffer (not device memory) for ``host_waits(device="cpu")``;
    returns ``t``. Called where offload allocates its host buffers."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return t
    if ptr:
        def forget(ref, ptr=ptr):
            if _host.get(ptr) is ref:
                _host.pop(ptr, None)

        _host[ptr] = weakref.ref(t, forget)
    return t


def _marked(t: torch.Tensor) -> bool:
    try:
        ref = _host.get(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return False
    return ref is not None and ref() is not None


def device_read(t: torch.Tensor) -> float:
    """``t.item()`` for a scalar a kernel reads from its own device's memory: on a CPU device the
    CPU kernel takes it as an argument, where a CUDA kernel reads the device tensor itself (no host
    wait there), so it is not counted."""
    if not _installed:
        return t.item()
    _local.exempt = getattr(_local, "exempt", 0) + 1
    try:
        return t.item()
    finally:
        _local.exempt -= 1


def _site() -> str:
    f = sys._getframe(1)
    while f is not None and (f.f_code.co_filename.startswith(_SKIP_PREFIXES)
                             or f.f_code.co_filename.endswith(_SKIP_SUFFIXES)):
        f = f.f_back
    if f is None:
        return "?"
    return f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}"


class _Watcher:
    def __init__(self, log: HostWaitLog, raise_on_wait: bool, raise_on_events: bool, cpu_is_device: bool):
        self.log, self.raise_on_wait, self.raise_on_events = log, raise_on_wait, raise_on_events
        self.cpu_is_device = cpu_is_device

    def on_device(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        kind = t.device.type
        if kind == "cpu":
            return self.cpu_is_device and not _marked(t)
        return kind != "meta"

    def is_host(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type == "cpu" and (not self.cpu_is_device or _marked(t))

    def note(self, kind: str, what: str) -> None:
        wait = HostWait(kind, what, _site())
        self.log.waits.append(wait)
        if (self.raise_on_events if kind == "event" else self.raise_on_wait):
            raise HostWaitError(f"zerocore.debug.host_waits: the host waits for the device here ({wait})")


class _Mode(TorchDispatchMode):
    def __init__(self, watcher: _Watcher):
        super().__init__()
        self.w = watcher

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not getattr(_local, "exempt", 0):
            w = self.w
            if func is _aten._local_scalar_dense.default:
                if w.on_device(args[0]):
                    w.note("item", "aten._local_scalar_dense (.item()/float()/bool())")
            elif func is _aten._to_copy.default:
                dev = kwargs.get("device")
                # from a tensor that is not CPU memory: with device="cpu" a CPU tensor's ``.to(options)``
                # (autograd's backward of a dtype cast) cannot be told from a ``.to("cpu")``, so not counted
                if dev is not None and torch.device(dev).type == "cpu" and not kwargs.get("non_blocking", False) \
                        and args[0].device.type not in ("cpu", "meta"):
                    w.note("copy", "aten._to_copy to the CPU")
            elif func is _aten.copy_.default:
                blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
                if blocking and w.is_host(args[0]) and w.on_device(args[1]):
                    w.note("copy", "aten.copy_ into host memory")
        return func(*args, **kwargs)


def _watchers() -> list:
    return getattr(_local, "watchers", None) or []


def _wrap(kind: str, what: str, fn, counts=lambda w, args, kwargs: True):
    def wrapper(*args, **kwargs):
        if not getattr(_local, "exempt", 0):
            for w in _watchers():
                if counts(w, args, kwargs):
                    w.note(kind, what)
        _local.exempt = getattr(_local, "exempt", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _local.exempt -= 1

    wrapper.__wrapped__ = fn
    return wrapper


def _native_counts(w, args, kwargs) -> bool:
    if not kwargs.get("sync", True) or not args:
        return False
    first = args[0]
    if isinstance(first, (list, tuple)):
        first = first[0] if first else None
    return w.on_device(first)


def _targets():
    from .. import ops
    from ..ops import norm

    cuda = torch.cuda
    yield cuda, "synchronize", "sync", "torch.cuda.synchronize", None
    yield cuda.Stream, "synchronize", "sync", "torch.cuda.Stream.synchronize", None
    for name in ("synchronize", "query", "elapsed_time"):
        yield cuda.Event, name, "event", f"torch.cuda.Event.{name}", None
    yield torch.Tensor, "tolist", "item", "Tensor.tolist", lambda w, a, k: w.on_device(a[0])
    for owner in (ops, norm):
        for name in ("sum_squares", "sum_squares_multi"):
            yield owner, name, "native", f"zerocore.ops.{name}", _native_counts


def _install() -> None:
    global _installed
    with _lock:
        _installed += 1
        if _installed > 1:
            return
        for owner, name, kind, what, counts in _targets():
            fn = getattr(owner, name, None)
            if fn is None:
                continue
            own = owner.__dict__.get(name, _INHERITED) if isinstance(owner, type) else fn
            _saved.append((owner, name, own))
            setattr(owner, name, _wrap(kind, what, fn, counts) if counts else _wrap(kind, what, fn))


def _uninstall() -> None:
    global _installed
    with _lock:
        _installed -= 1
        if _installed:
            return
        while _saved:
            owner, name, fn = _saved.pop()
            if fn is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, fn)


@contextlib.contextmanager
def host_waits(raise_on_wait: bool = False, *, device=None, raise_on_events: bool = False, log: HostWaitLog | None = None):
    """Records every host wait for the device on this thread inside the block (see the module's
    docstring for what counts) into a :class:`HostWaitLog`, which it yields; ``log``: append to
    this one. ``raise_on_wait``: raise :class:`HostWaitError` at the first one, naming its call
    site. ``device``: ``"cpu"`` counts CPU tensors as device tensors (a CPU engine, tests)."""
    log = HostWaitLog() if log is None else log
    w = _Watcher(log, raise_on_wait, raise_on_events,
                 cpu_is_device=device is not None and torch.device(device).type == "cpu")
    _install()
    watchers = _watchers()
    _local.watchers = watchers + [w]
    try:
        with _Mode(w):
            yield log
    finally:
        _local.watchers = watchers
        _uninstall()
