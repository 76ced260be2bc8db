"""Asynchronous save: the state is copied into host memory at the call (the only part training
waits for), then a background thread writes the files and publishes the tag with the same atomic
protocol as a synchronous save. Its barriers run on a gloo group of their own (``side_comm``), so
they never interleave with the training collectives of the main thread.

The next ``save_checkpoint`` / ``load_checkpoint`` of the engine waits for the pending save
first; call ``handle.wait()`` before ``destroy_process_group()`` (the background barriers need
the process group). An error in the background is raised by ``wait()``.
"""
from __future__ import annotations

import os
import threading

import torch

from ..comm import side_comm
from .save import TILE_ELEMS, check_can_save, make_plan, run_save


class AsyncSave:
    """A save in flight: ``wait()`` returns the tag directory once published (or raises)."""

    def __init__(self, plan, save_dir: str):
        self._result: str | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(plan, save_dir), name="zerocore-checkpoint")
        self._thread.start()

    def _run(self, plan, save_dir: str) -> None:
        try:
            self._result = run_save(plan, save_dir)
        except BaseException as e:  # handed to wait()
            self._error = e

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
    # the copy training waits for: every tile of the owned state, into fresh host memory
    staged = []
    for shard in engine.shards:
        g = shard.group
        for lo, hi, state in shard.state_tiles(TILE_ELEMS):
            staged.append((g.layout, g.lo + lo, g.lo + hi,
                           {k: t.detach().to("cpu", copy=True) for k, t in state.items()}))
    plan = make_plan(engine, tag, client_state, comm, lambda: iter(staged), save_latest=save_latest)
    plan.extras = [(names, kind, t.detach().to("cpu", copy=True)) for names, kind, t in plan.extras]
    handle = engine._zc_pending_save = AsyncSave(plan, os.fspath(save_dir))
    return handle
