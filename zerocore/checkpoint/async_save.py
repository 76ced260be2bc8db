"""Asynchronous save: at the call, the state is copied into host memory laid out as the file it
will be (aligned I/O buffers, checksummed in the same pass: the only part training waits for),
then a background thread writes those buffers as they are and publishes the tag with the same
atomic protocol as a synchronous save. The buffers stay with the engine for its next
asynchronous save (fresh memory costs page faults, more than the copy itself): an engine that
saves asynchronously keeps host memory of the size of its rank's checkpoint file. Its barriers run on a gloo group of their own (``side_comm``), so
they never interleave with the training collectives of the main thread.

The next ``save_checkpoint`` / ``load_checkpoint`` of the engine waits for the pending save
first; call ``handle.wait()`` before ``destroy_process_group()`` (the background barriers need
the process group). An error in the background is raised by ``wait()``.
"""
from __future__ import annotations

import os
import threading
import time

import torch

from ..comm import side_comm
from .blockio import ImageSink
from .staging import held_buffers
from .save import _write_rank, check_can_save, live_tiles, make_plan, run_save


class AsyncSave:
    """A save in flight: ``wait()`` returns the tag directory once published (or raises)."""

    def __init__(self, plan, save_dir: str, prepared: tuple):
        self._result: str | None = None
        self._error: BaseException | None = None
        self.written_at: float | None = None  # perf_counter() when the tag was published
        self._thread = threading.Thread(target=self._run, args=(plan, save_dir, prepared), name="zerocore-checkpoint")
        self._thread.start()

    def _run(self, plan, save_dir: str, prepared: tuple) -> None:
        try:
            self._result = run_save(plan, save_dir, prepared)
        except BaseException as e:  # handed to wait()
            self._error = e
        finally:
            prepared[1].release()  # the buffers go back to the engine's cache
            self.written_at = time.perf_counter()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> str:
        self._thread.join()
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        return self._result


def wait_pending(engine) -> None:
    pending = getattr(engine, "_zc_pending_save", None)
    if pending is not None:
        engine._zc_pending_save = None
        pending.wait()


@torch.no_grad()
def save_async(engine, save_dir: str, tag=None, client_state=None, save_latest: bool = True) -> AsyncSave:
    wait_pending(engine)
    tag = check_can_save(engine, tag)
    comm = getattr(engine, "_zc_side_comm", None)
    if comm is None:
        comm = engine._zc_side_comm = side_comm(engine.comm)
    plan = make_plan(engine, tag, client_state, comm, live_tiles(engine), save_latest=save_latest)
    image = ImageSink(held_buffers(engine, create=True))
    index = _write_rank(plan, None, sink=image)  # the copy training waits for
    handle = engine._zc_pending_save = AsyncSave(plan, os.fspath(save_dir), (index, image))
    return handle
