"""The host step off the training thread: one worker steps the owned host shards tile by tile,
in the order the next forward needs them, and marks each group ready when its updated 16-bit
values are back on the device. A unit's gather waits only for its own group (``Ready.wait``).

Threads: the worker runs the project's OpenMP Adam kernel (which drops the GIL) with
``threads`` OpenMP threads of its own, set once on the worker (OpenMP's thread count is per
calling thread). With the model on a CUDA device the training thread only launches kernels, so
the worker takes every core but one, keeping the training thread responsive; with the model on
the CPU both compete for the same cores and the worker takes the training thread's count.
"""
from __future__ import annotations

import queue
import threading
import weakref
from typing import Callable

import torch

from ..comm import lifetime


class Ready:
    """Whether a group's owned parameters hold this step's update (set by the worker). On CUDA
    also a device event: the copy back to the device was issued on a side stream, and the
    stream that gathers waits for it, not the host."""

    def __init__(self):
        self._done = threading.Event()
        self._done.set()
        self.cuda_event = None
        self.error: BaseException | None = None

    def clear(self) -> None:
        self._done.clear()
        self.cuda_event = None

    def set(self, cuda_event=None) -> None:
        self.cuda_event = cuda_event
        self._done.set()

    def wait(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise RuntimeError("zerocore offload: the host optimizer step failed on the worker thread") from self.error
        self._stream_waits()

    def wait_own(self) -> None:
        """``wait`` for a step the caller handed over and waits for at once (stages 1/2 on the worker):
        its error is raised as it was raised on the worker, as if the caller had run it, and cleared
        (the caller handles it; a later step may be tried again, as with the step run inline)."""
        error = self.finish()
        if error is not None:
            raise error
        self._stream_waits()

    def finish(self) -> BaseException | None:
        """Waits for the job and returns (and clears) its error, if any, raising nothing and making no
        stream wait: for a job whose result the caller may not use (offload/speculation.py)."""
        self._done.wait()
        error, self.error = self.error, None
        return error

    def _stream_waits(self) -> None:
        if self.cuda_event is not None:  # the device's copy back: the stream waits for it, not the host
            torch.cuda.current_stream().wait_event(self.cuda_event)


def _worker(jobs: queue.Queue, threads: int) -> None:
    torch.set_num_threads(threads)
    while True:
        job = jobs.get()
        if job is None:
            return
        fn, ready = job
        try:
            ev = fn()
        except BaseException as e:  # surfaced on the training thread at its wait
            ready.error = e
            ev = None
        ready.set(ev)
        # the step (a closure over its shard) must not stay alive in this frame while the worker
        # waits for the next job: the engine would not be freed until then
        del job, fn, ready, ev


class HostStepper:
    """One worker thread (started on first use, stopped when the stepper is collected) running
    submitted steps in submission order."""

    def __init__(self, threads: int):
        self.threads = max(1, int(threads))
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    def submit(self, gi: int, fn: Callable[[], object], ready: Ready) -> None:
        """Runs ``fn`` (returning an optional CUDA event) on the worker, then sets ``ready``."""
        if self._thread is None:
            self._thread = threading.Thread(target=_worker, args=(self._jobs, self.threads),
                                            name="zerocore-host-step", daemon=True)
            self._thread.start()
            weakref.finalize(self, self._jobs.put, None)
            lifetime.note_worker(self)  # joined before interpreter exit (a step still running would abort it)
        ready.clear()
        self._jobs.put((fn, ready))

    def close(self, timeout_s: float | None = None) -> None:
        """Lets the queued steps finish, then stops the worker (a later submit starts a new one)."""
        thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            self._jobs.put(None)
            thread.join(timeout_s)
