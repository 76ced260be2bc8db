"""What zerocore starts, it stops: the process groups it creates (the default one when the script
did not create it, and its own side groups) and its background workers, torn down at
``engine.destroy()`` and at interpreter exit.

Why at exit: gloo runs each collective on a worker thread of its process group, and that thread
drops its reference to the finished collective (and to the tensors it moved) a moment after the
caller's ``wait()`` returns. If the interpreter is already finalizing then, freeing a tensor that
Python gave up needs the GIL, the thread is made to exit while inside C++, and the process aborts
with "terminate called without an active exception" after the script's last line (measured here:
3 to 6 runs in 10 of a two-rank job). Destroying the group before finalization (an ``atexit``
hook) joins those threads while the interpreter is whole where torch lets the group go; where
its threads outlive the destroy (torch 2.13), exit then pauses ``EXIT_GRACE_S`` with the GIL released
so they finish with the last collective first. The same holds for a host-step worker still running
a step: it is joined first.

At ``engine.destroy()`` only once no engine is left and only when zerocore created the default
group (see ``engine_destroyed``); at exit always. Order: workers, then side groups (newest first), then the default group, and only the default
group zerocore itself created (a group the script created is the script's to destroy, as torch
asks of anyone who creates one). No barrier: a rank whose peer is gone, or never calls teardown,
finishes at once (gloo closes its connections; the peer's next collective on them raises
"Connection closed by peer", an error, not an abort; measured). A collective this rank queued and
never waited for is finished first (gloo's destructor runs its queue), so after an uncaught
exception exit leaves the groups alone: a queued collective whose peers went elsewhere would hold
the exit up to the group's timeout.

A default group torn down at ``destroy()`` is created again by the next engine: on the store of
the first one, under a fresh key prefix (the first group's keys are still there, and gloo's
rendezvous would read them).
"""
from __future__ import annotations

import atexit
import datetime
import os
import sys
import threading
import time
import weakref

import torch.distributed as dist


class _Registry:
    def __init__(self):
        self.default = None  # weakref to the default group zerocore created (None: none, or the script's)
        self.base_store = None  # the first default group's store (a later default group is created on it)
        self.incarnation = 0
        self.side: dict[object, object] = {}  # key -> side group zerocore created
        self.comms: weakref.WeakSet = weakref.WeakSet()  # Comms over those side groups
        self.workers: weakref.WeakSet = weakref.WeakSet()  # objects with close(timeout_s)
        # live (not destroyed) engines -> the default group they were built on (a weakref; None: none)
        self.engines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # process-wide caches (checkpoint I/O buffers and handles): emptied when no engine is left
        self.caches: list = []
        self.hooked = False
        self.lock = threading.RLock()


_R = _Registry()


class _Released:
    """What a Comm over a torn-down side group holds instead of the group: using it says so."""

    def __repr__(self) -> str:
        return "<process group torn down by zerocore (engine.destroy() or interpreter exit)>"


RELEASED = _Released()


def _hook() -> None:
    if not _R.hooked:
        _R.hooked = True
        atexit.register(_at_exit)


# -- creation ------------------------------------------------------------------------------------
def init_default(backend: str, timeout_s: float | None) -> None:
    """Initializes the default group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) and remembers that zerocore owns it."""
    kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
    with _R.lock:
        if _R.base_store is None:
            dist.init_process_group(backend, **kwargs)
            _R.base_store = dist.distributed_c10d._get_default_store()
        else:  # after a teardown: same store, keys of their own
            _R.incarnation += 1
            store = dist.PrefixStore(f"zerocore/default/{_R.incarnation}", _R.base_store)
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), **kwargs)
        _R.default = weakref.ref(dist.distributed_c10d._get_default_group())
        _hook()


def owns_default() -> bool:
    """Whether the current default group is one zerocore created."""
    ref = _R.default
    return (ref is not None and dist.is_available() and dist.is_initialized()
            and ref() is dist.distributed_c10d._get_default_group())


def new_side_group(key, ranks, **kwargs):
    """A new gloo group over ``ranks`` (None: all) that zerocore owns; with a ``key`` the same group
    is returned while it lives (created collectively on first use: call on every rank of ``ranks``)."""
    with _R.lock:
        group = _R.side.get(key) if key is not None else None
        if group is not None and group in dist.distributed_c10d._world.pg_map:
            return group
        group = dist.new_group(ranks=ranks, backend="gloo", **kwargs)
        _R.side[key if key is not None else ("unkeyed", id(group))] = group
        _hook()
        return group


def note_comm(comm) -> None:
    """Called by Comm for every group: remembers the Comms over zerocore's side groups, so that
    tearing a group down drops their references too (the group's threads are joined only when the
    last reference goes)."""
    if comm.group is not None and any(comm.group is g for g in _R.side.values()):
        _R.comms.add(comm)
    # the exit pause applies to a group the script created too (Accelerate's): tests/integrations/
    # accelerate_run.py (stage 2, 2 ranks) aborted at exit in 2 of 16 runs without it, 0 of 28 with it
    _hook()


def note_worker(worker) -> None:
    """A background worker (``close(timeout_s)``) to stop before interpreter exit."""
    _R.workers.add(worker)
    _hook()


def _current_default():
    return dist.distributed_c10d._get_default_group() if dist.is_available() and dist.is_initialized() else None


def engine_started(engine) -> None:
    pg = _current_default()
    _R.engines[engine] = weakref.ref(pg) if pg is not None else None
    weakref.finalize(engine, _engine_freed)  # an engine dropped without destroy()


def note_cache(release) -> None:
    """``release()`` empties a process-wide cache of zerocore's (buffers kept between checkpoints, say):
    called once no engine is left, so a process that is done with zerocore holds none of its memory."""
    _R.caches.append(release)


def _release_caches_if_idle() -> None:
    if not any(True for _ in _R.engines.keys()):  # dead engines are skipped by the weak mapping
        for release in _R.caches:
            release()


def _engine_freed() -> None:
    _release_caches_if_idle()


# -- teardown ------------------------------------------------------------------------------------
def release_side_group(group) -> None:
    """Destroys one side group zerocore created (Comms over it can no longer be used)."""
    with _R.lock:
        for k in [k for k, g in _R.side.items() if g is group]:
            del _R.side[k]
        _destroy(group)


def _destroy(group) -> None:
    for comm in list(_R.comms):
        if comm.group is group:
            comm.group = RELEASED
    try:
        if group in dist.distributed_c10d._world.pg_map:
            dist.destroy_process_group(group)
    except (RuntimeError, ValueError) as e:  # already gone with the default group
        _say(f"side process group teardown: {e}")


def engine_destroyed(engine, collective: bool = True) -> None:
    """``engine.destroy()``: once no engine is left and zerocore created the default group, all
    that zerocore created is torn down (a later engine creates what it needs again). Side groups
    over a group the script created stay until exit: they are reused by the next engine, and a
    rank that destroyed its engine after an error (``collective`` false) must not leave the others
    holding groups it no longer has."""
    _R.engines.pop(engine, None)
    pg = _current_default()
    users = [e for e, ref in list(_R.engines.items()) if ref is not None and ref() is pg]
    if collective and not users and owns_default():
        teardown()
    _release_caches_if_idle()


def teardown(worker_timeout_s: float = 120.0) -> None:
    """Stops zerocore's workers, destroys its side groups (newest first) and then the default
    group if zerocore created it. Never waits for another rank."""
    with _R.lock:
        for w in list(_R.workers):
            try:
                w.close(worker_timeout_s)
            except Exception as e:  # noqa: BLE001 - teardown goes on; said on stderr
                _say(f"stopping {type(w).__name__}: {e}")
        for key in reversed(list(_R.side)):
            _destroy(_R.side.pop(key))
        if owns_default():
            try:
                dist.destroy_process_group()
            except (RuntimeError, ValueError) as e:
                _say(f"default process group teardown: {e}")
        _R.default = None


def _at_exit() -> None:
    if getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None:
        # the script died of an exception: a collective of this rank may still be queued, and
        # destroying its group would wait for it (up to the group's timeout); the exit code is
        # already non-zero
        for w in list(_R.workers):
            w.close(10.0)
        _never_finalize_groups()
        return
    teardown()
    _R.base_store = None
    time.sleep(EXIT_GRACE_S)


# How long exit lets gloo's worker threads run (the GIL released) after zerocore's groups are
# destroyed; also where the script owns the group (it is not destroyed here, its threads live on).
# With torch 2.13 a destroyed group's threads can outlive destroy_process_group (its C++ object
# is still referenced), and the worker that ran the last step's all-gather (issued and waited ~2 ms
# before exit) may not yet have dropped it: dropping it during finalization aborted the process
# ("terminate called without an active exception"; core dumps: ~AsyncAllgatherWork ->
# TensorImpl::decref_pyobject -> take_gil on a gloo thread while Py_FinalizeEx collects). Measured
# with tests/exit_job.py (stage 2, 2 ranks, no destroy): 1 of 20 and 1 of 40 jobs aborted without the
# pause (4 of 60 with the collectives' tensors held longer in Comm, which did not help), 0 of 60 with
# it. The peers are not waited for: only time.
EXIT_GRACE_S = 0.05


def _never_finalize_groups() -> None:
    """After an uncaught exception: every live process group gets one reference that is never
    given back, so finalization (whose garbage collection reaches groups held in reference cycles)
    never runs gloo's destructor, which would first wait for a queued collective whose peers went
    elsewhere. The process is ending; the operating system closes the group's sockets."""
    import ctypes

    groups = list(getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", {}) or {})
    groups += [g for g in list(_R.side.values()) if g is not None]
    for g in groups:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(g))


def _say(text: str) -> None:
    print(f"zerocore: {text}", file=sys.stderr, flush=True)
