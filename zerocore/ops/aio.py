"""NVMe I/O: asynchronous reads and writes of CPU tensors to files, the storage half of NVMe
offload.

:class:`AsyncIO` is a handle in the spirit of DeepSpeed's ``aio_handle``::

    h = AsyncIO(block_size=1 << 20, queue_depth=8, threads=1)
    buf = aligned_pinned_empty(n, dtype=torch.float32)   # 4096-aligned, mlock'ed
    h.async_pwrite(buf, "/nvme/swap/shard0.bin")
    ...                                                  # overlap other work
    h.wait()                                             # -> 1; raises the first error
    h.sync_pread(buf, "/nvme/swap/shard0.bin")

Each request is cut into ``block_size`` blocks spread over ``threads`` workers, each keeping
up to ``queue_depth`` blocks in flight on an O_DIRECT file descriptor (libaio, io_uring, or a
pool of threads doing pread/pwrite where neither is built or allowed).
Any size at any offset works: memory that is not 4096-byte aligned goes through the engine's
aligned bounce buffers (an extra copy, logged once at debug level), and an unaligned head or
tail of the file range goes through the page cache, so a file ends exactly where its data
does. Writes create the file if needed and never truncate it.

Errors: a bad argument raises TypeError/ValueError naming it; a missing file, a directory, a
read past the end of the file raise OSError (FileNotFoundError, IsADirectoryError, ...) from
the call that submits it, naming the file; a failure during the transfer (no space, an I/O
error) is raised by :meth:`AsyncIO.wait` (or the ``sync_`` call) naming the file, the offset
and the errno text. The handle stays usable after any of them.

Requests in flight together run concurrently, in no order: separate a write and a read of
the same bytes with :meth:`AsyncIO.wait`.
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping

import torch

from ..config.aio import BACKENDS, CONFIG_DEFAULTS, bool_arg, config_to_kwargs, int_arg
from . import _loader
from ._checks import INT64_MAX, check_int

log = logging.getLogger("zerocore.ops")

ALIGNMENT = 4096
# What backend="auto" tries, in order: the first one usable here. libaio first: on this
# project's measurements (benchmarks/results/aio_*.json) libaio and io_uring were within noise of
# each other, libaio is what DeepSpeed users run, and io_uring is often disabled by container
# policy. The thread pool (blocking pread/pwrite, always built) last: it serves where neither
# kernel interface was built (no headers at build time) or is allowed.
AUTO_ORDER = ("libaio", "io_uring", "threadpool")
__all__ = ["AsyncIO", "aligned_pinned_empty", "available_backends", "auto_backend", "aio_unavailable", "BACKENDS",
           "AUTO_ORDER", "CONFIG_DEFAULTS", "config_to_kwargs"]


def aio_unavailable() -> str | None:
    """None when this installation has the NVMe I/O engine, else why not (and what to install)."""
    try:
        lib = _loader.load("aio")
    except Exception as exc:  # the extension itself is missing: say so, do not crash
        return f"the native extension is not available: {exc}"
    if getattr(lib, "WITH_AIO", False):
        return None
    return _loader.unavailable_parts().get("aio", "the extension was built without NVMe I/O")


def available_backends() -> dict:
    """{backend: None where usable here, else why not}, for every backend of this build
    (libaio, io_uring, threadpool). A backend left out of the build is reported with the build's
    reason (which header was missing, or the env var that left it out)."""
    usable = dict(_native().aio_backends())
    built_without = _loader.unavailable_parts()
    for backend, why in usable.items():
        if why is not None and built_without.get(f"aio.{backend}"):
            usable[backend] = built_without[f"aio.{backend}"]
    return usable


def auto_backend(usable: Mapping | None = None) -> str | None:
    """The backend ``backend='auto'`` picks here (None: none is usable)."""
    usable = available_backends() if usable is None else usable
    return next((b for b in AUTO_ORDER if usable.get(b) is None), None)


def _native():
    lib = _loader.load("aio")
    if not getattr(lib, "WITH_AIO", False):
        reason = _loader.unavailable_parts().get("aio", "the extension was built without NVMe I/O")
        raise _loader.NativeBuildError(f"zerocore's NVMe I/O (AsyncIO) is not in this build: {reason}")
    return lib


def _shape(shape) -> tuple[int, ...]:
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (tuple, list, torch.Size)) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise TypeError(f"shape must be an int or a sequence of non-negative ints, got {shape!r}")
    return tuple(shape)


_unlocked_logged = False


def aligned_pinned_empty(shape, dtype: torch.dtype = torch.float32, *, lock: bool = True) -> torch.Tensor:
    """An uninitialised CPU tensor whose memory is 4096-byte aligned and page-locked (mlock, best
    effort: without CAP_IPC_LOCK or enough RLIMIT_MEMLOCK it stays pageable, logged once at
    debug level), the buffer O_DIRECT transfers want: no bounce copy. The memory is returned
    to the system when the tensor's storage dies. (Locked with mlock, not registered with
    CUDA: for pinned host<->device copies use torch's pin_memory.)"""
    global _unlocked_logged
    shape = _shape(shape)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw, locked = _native().aio_alloc_aligned(numel * itemsize, bool(lock))
    if lock and not locked and not _unlocked_logged:
        _unlocked_logged = True
        log.debug("zerocore aio: mlock of an aligned buffer failed (RLIMIT_MEMLOCK too small?): the buffer is "
                  "aligned but pageable")
    return raw.view(dtype).view(shape)


class AsyncIO:
    """Asynchronous tensor <-> file transfers (see the module docstring).

    ``block_size``: bytes per I/O (a multiple of 4096). ``queue_depth``: I/Os in flight per
    worker. ``threads``: workers, each with its own kernel queue; one request is split between
    them. ``backend``: 'libaio', 'io_uring', 'threadpool' (``queue_depth`` threads per worker
    doing blocking pread/pwrite: no kernel AIO needed, slower) or 'auto' (the first of
    :data:`AUTO_ORDER` usable here; see :func:`available_backends`). ``single_submit``: submit one I/O per system call instead of a batch.
    ``overlap_events``: refill the queue as each I/O completes (False: wait for the whole batch).
    ``direct``: 'auto' (O_DIRECT; where a file system refuses it, the page cache, with a
    warning), 'require' / True (refusal is an error), 'off' / False (always the page cache).
    """

    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 8, threads: int = 1, *,
                 backend: str = "auto", single_submit: bool = False, overlap_events: bool = True,
                 direct="auto"):
        block_size = int_arg("block_size", block_size, ALIGNMENT, 1 << 30)
        if block_size % ALIGNMENT:
            raise ValueError(f"block_size must be a multiple of {ALIGNMENT} (O_DIRECT alignment), got {block_size}")
        queue_depth = int_arg("queue_depth", queue_depth, 1, 4096)
        threads = int_arg("threads", threads, 1, 1024)
        single_submit = bool_arg("single_submit", single_submit)
        overlap_events = bool_arg("overlap_events", overlap_events)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if direct is True or direct is False:
            direct = "require" if direct else "off"
        if direct not in ("auto", "require", "off"):
            raise ValueError(f"direct must be 'auto', 'require', 'off', True or False, got {direct!r}")
        lib = _native()
        if backend == "auto":
            usable = available_backends()
            backend = auto_backend(usable)
            if backend is None:
                raise OSError(f"no asynchronous I/O backend is usable here: {usable}")
        self._engine = lib.AioEngine(block_size, queue_depth, threads, backend, single_submit, overlap_events, direct)
        self.block_size, self.queue_depth, self.threads = block_size, queue_depth, threads
        self.backend, self.single_submit, self.overlap_events, self.direct = (backend, single_submit, overlap_events,
                                                                              direct)
        self._bounce_logged = False
        self._fallback_warned = False

    @classmethod
    def from_config(cls, config: Mapping | None = None, **overrides) -> "AsyncIO":
        """A handle from DeepSpeed's ``aio`` section: ``block_size``, ``queue_depth``,
        ``intra_op_parallelism`` (alias ``thread_count``) -> ``threads``, ``single_submit``,
        ``overlap_events``; plus zerocore's ``backend`` and ``direct``. A whole DeepSpeed config
        (a mapping with an ``aio`` key) is accepted too. Missing keys take DeepSpeed's defaults;
        unknown keys are named in a warning; wrong values raise an error naming the key."""
        return cls(**config_to_kwargs(config, **overrides))

    # Transfers ---------------------------------------------------------------------------

    def async_pwrite(self, tensor: torch.Tensor, path, offset: int = 0) -> None:
        """Starts writing ``tensor``'s bytes to ``path`` at byte ``offset``; :meth:`wait` finishes
        it. Do not modify the tensor until then."""
        self._submit(True, tensor, path, offset, "async_pwrite")

    def async_pread(self, tensor: torch.Tensor, path, offset: int = 0) -> None:
        """Starts filling ``tensor`` from ``path`` at byte ``offset``; :meth:`wait` finishes it."""
        self._submit(False, tensor, path, offset, "async_pread")

    def sync_pwrite(self, tensor: torch.Tensor, path, offset: int = 0) -> int:
        """Writes ``tensor`` to ``path`` at ``offset`` and returns the bytes written."""
        return self._run(True, tensor, path, offset, "sync_pwrite")

    def sync_pread(self, tensor: torch.Tensor, path, offset: int = 0) -> int:
        """Fills ``tensor`` from ``path`` at ``offset`` and returns the bytes read."""
        return self._run(False, tensor, path, offset, "sync_pread")

    def wait(self) -> int:
        """Waits for every async request; returns how many completed since the last wait and
        raises the first error among them (the others are still finished; the handle stays
        usable)."""
        if self._engine is None:
            raise ValueError("wait: this AsyncIO handle is closed")
        return self._engine.wait()

    @property
    def pending(self) -> int:
        """Async requests submitted and not yet finished."""
        return 0 if self._engine is None else self._engine.pending()

    def close(self) -> None:
        """Waits for what is in flight (errors dropped) and stops the workers."""
        if self._engine is not None:
            try:
                self._engine.wait()
            except OSError:
                pass
            self._engine = None

    def __enter__(self) -> "AsyncIO":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.wait()
        self.close()

    def __repr__(self) -> str:
        return (f"AsyncIO(block_size={self.block_size}, queue_depth={self.queue_depth}, threads={self.threads}, "
                f"backend={self.backend!r}, single_submit={self.single_submit}, "
                f"overlap_events={self.overlap_events}, direct={self.direct!r})")

    # DeepSpeed aio_handle spellings -------------------------------------------------------

    def get_block_size(self) -> int:
        return self.block_size

    def get_queue_depth(self) -> int:
        return self.queue_depth

    def get_intra_op_parallelism(self) -> int:
        return self.threads

    get_thread_count = get_intra_op_parallelism

    def get_single_submit(self) -> bool:
        return self.single_submit

    def get_overlap_events(self) -> bool:
        return self.overlap_events

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        return aligned_pinned_empty(num_elem, example_tensor.dtype)

    # Internals ----------------------------------------------------------------------------

    def _check(self, tensor, path, offset, op: str):
        if self._engine is None:
            raise ValueError(f"{op}: this AsyncIO handle is closed")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{op}: tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise ValueError(f"{op}: tensor is on {tensor.device}; AsyncIO moves CPU tensors (copy it into a "
                             "buffer from aligned_pinned_empty first)")
        if not tensor.is_contiguous():
            raise ValueError(f"{op}: tensor must be contiguous (call .contiguous())")
        try:
            path = os.fsdecode(os.fspath(path))
        except TypeError:
            raise TypeError(f"{op}: path must be a str or os.PathLike, got {type(path).__name__}") from None
        if not path:
            raise ValueError(f"{op}: path is empty")
        if "\0" in path:  # the C library would stop at the NUL and write to a truncated path
            raise ValueError(f"{op}: path contains a NUL byte: {path!r}")
        offset = check_int(f"{op}: offset", offset, low=0, high=INT64_MAX - tensor.numel() * tensor.element_size())
        if tensor.numel() and tensor.data_ptr() % ALIGNMENT and not self._bounce_logged:
            self._bounce_logged = True
            log.debug("zerocore aio: %s of a tensor that is not %d-byte aligned (address 0x%x): its blocks are "
                      "copied through aligned bounce buffers; allocate it with aligned_pinned_empty to avoid the "
                      "copy", op, ALIGNMENT, tensor.data_ptr())
        return tensor.detach(), path

    def _note(self, info, path: str) -> None:
        direct, _bounced = info
        if not direct and self.direct == "auto" and not self._fallback_warned:
            self._fallback_warned = True
            log.warning("zerocore aio: the file system of '%s' refuses O_DIRECT; AsyncIO uses the page cache "
                        "for such files (slower, and it fills RAM)", path)

    def _submit(self, write: bool, tensor, path, offset, op: str) -> None:
        tensor, path = self._check(tensor, path, offset, op)
        self._note(self._engine.submit(write, tensor, path, offset), path)

    def _run(self, write: bool, tensor, path, offset, op: str) -> int:
        tensor, path = self._check(tensor, path, offset, op)
        self._note(self._engine.run(write, tensor, path, offset), path)
        return tensor.numel() * tensor.element_size()

