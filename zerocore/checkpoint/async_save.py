"""Asynchronous save: the state is copied into host memory laid out as the file it will be
(aligned I/O buffers, checksummed in the same pass), then written as it is and published with the
same atomic protocol as a synchronous save, all on a background thread. The call returns at once
(after copying the small things that the next forward may change: buffers, counters, RNG state,
the client state); the engine's next ``step`` waits for the copy before it updates the state
(state on NVMe is copied before the call returns: its tiles pass through the swap buffers). The
buffers stay with the engine for its next asynchronous save and its loads (fresh memory costs page
faults, more than the copy itself): an engine that saves asynchronously keeps host memory of the
size of its rank's checkpoint file. Its barriers run on a gloo group of their own
(``side_comm``), so they never interleave with the training collectives of the main thread.

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
from ..runtime.checkpoint_marks import wait_pending
from .block_writer import ImageSink
from .staging import held_buffers
from .save import _write_rank, check_can_save, live_tiles, make_plan, run_save


class AsyncSave:
    """A save in flight: ``wait()`` returns the tag directory once published (or raises).

    The state's copy into the host image (``snapshot``) runs on the save's thread too when the
    state's tiles are views of resident memory: only the next update of that state (the engine's
    ``step``, which calls :meth:`snapshot_taken`) must wait for it, so the copy overlaps the
    forward and backward that come first."""

    def __init__(self, plan, save_dir: str, image: ImageSink):
        self._result: str | None = None
        self._error: BaseException | None = None
        self.written_at: float | None = None  # perf_counter() when the tag was published
        self.snapshot = threading.Event()  # set once the image holds the state (or the copy failed)
        self._thread = threading.Thread(target=self._run, args=(plan, save_dir, image), name="zerocore-checkpoint")
        self._thread.start()

    def _run(self, plan, save_dir: str, image: ImageSink) -> None:
        try:
            try:
                prepared = (_write_rank(plan, None, sink=image), image)
            except BaseException as e:  # noqa: BLE001 - every rank must still learn of it (run_save agrees)
                prepared = e
            finally:
                self.snapshot.set()
            self._result = run_save(plan, save_dir, prepared)
        except BaseException as e:  # handed to wait()
            self._error = e
        finally:
            image.release()  # the buffers go back to the engine's cache
            self.written_at = time.perf_counter()

    def snapshot_taken(self) -> None:
        """Returns once the state has been copied (the engine may change it from then on)."""
        self.snapshot.wait()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> str:
        self._thread.join()
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        return self._result


@torch.no_grad()
def save_async(engine, save_dir: str, tag=None, client_state=None, save_latest: bool = True) -> AsyncSave:
    wait_pending(engine)
    tag = check_can_save(engine, tag)
    comm = getattr(engine, "_zc_side_comm", None)
    if comm is None:
        comm = engine._zc_side_comm = side_comm(engine.comm)
    plan = make_plan(engine, tag, client_state, comm, live_tiles(engine), save_latest=save_latest)
    # buffers (running statistics) change in the next forward: copied now (they are small)
    plan.extras = [(names, kind, t.detach().clone()) for names, kind, t in plan.extras]
    image = ImageSink(held_buffers(engine, create=True))
    handle = engine._zc_pending_save = AsyncSave(plan, os.fspath(save_dir), image)
    if not all(shard.tiles_kept for shard in engine.shards):
        handle.snapshot_taken()  # NVMe: its tiles stream through the swap buffers training uses next
    return handle
