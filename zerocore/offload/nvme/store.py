"""One rank's swap folder for one run, ``<nvme_path>/zerocore_swap/<run id>/rank<r>/``, the I/O
handles that move records in and out of it, and the pinned buffers every tile passes through.

- The buffers (``buffer_count`` records of the largest tile, from ``ops.aligned_pinned_empty``)
  are shared by all of the rank's groups: they are the only host memory the optimizer state
  occupies, whatever the model size.
- Reads and writes go through two ``ops.AsyncIO`` handles built from the config's ``aio``
  section (one for reads, one for writes, so waiting for one never waits for the other).
  Every transfer error is re-raised as SwapError naming the file, the offset and the step.
- The folder is removed at a normal exit (``close``, the store's collection, or interpreter
  exit). A crashed run leaves its folder behind: its run id is in every record header, so a new
  run never reads it; its folders are named in a warning so the user can reclaim the space.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import socket
import uuid
import weakref

import torch

from ... import ops
from ...ops.aio import config_to_kwargs
from .records import Record, SwapError, record_bytes

log = logging.getLogger("zerocore.offload")
SWAP_DIR = "zerocore_swap"


def _remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(path))  # the run folder, once its last rank is gone
    except OSError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leftover_runs(root: str) -> list[str]:
    """Run folders under ``root`` left by processes of this host that no longer exist."""
    out = []
    if not os.path.isdir(root):
        return out
    host = socket.gethostname()
    for run in sorted(os.listdir(root)):
        for rank in sorted(os.listdir(os.path.join(root, run))) if os.path.isdir(os.path.join(root, run)) else ():
            try:
                with open(os.path.join(root, run, rank, "owner.json")) as f:
                    owner = json.load(f)
            except (OSError, ValueError):
                continue
            if owner.get("host") == host and not _alive(int(owner.get("pid", 0))):
                out.append(os.path.join(root, run))
                break
    return out


class SwapStore:
    def __init__(self, nvme_path: str, rank: int, aio: dict, buffer_count: int, run_id: str | None = None,
                 what: str = "optimizer state"):
        self.run = run_id or uuid.uuid4().hex
        self.what = what  # what the files hold, for error messages
        self.rank = rank
        root = os.path.join(nvme_path, SWAP_DIR)
        stale = leftover_runs(root)
        if stale:
            log.warning("zerocore nvme: swap folders of earlier runs that did not exit normally: %s; they are never "
                        "read by this run (record headers carry the run id); delete them to reclaim the space",
                        ", ".join(stale))
        self.dir = os.path.join(root, self.run, f"rank{rank}")
        os.makedirs(self.dir, exist_ok=False)
        with open(os.path.join(self.dir, "owner.json"), "w") as f:
            json.dump({"run": self.run, "pid": os.getpid(), "host": socket.gethostname()}, f)
        self._finalizer = weakref.finalize(self, _remove, self.dir)  # also runs at interpreter exit
        kwargs = config_to_kwargs(aio)
        # one read handle; buffer_count - 1 write lanes, tile k on lane k % lanes: the buffer tile k + 1 is
        # read into last held tile k + 1 - buffer_count, on the lane tile k is about to use, so waiting for
        # that write never waits for the newer ones (AsyncIO.wait waits for all of a handle's requests)
        self.reader = ops.AsyncIO(**kwargs)
        self.writers = [ops.AsyncIO(**kwargs) for _ in range(max(1, buffer_count - 1))]
        self.buffer_count = buffer_count
        self._pool = None  # one allocation: buffer_count records of the largest tile
        self._pool_tile = 0
        # (file, commit, tiles, first sequence number): first tiles read into the buffers ahead of their pass
        self.ahead: tuple[str, int, int, int] | None = None
        self.seq = 0  # the running tile sequence: tile sequence s passes through buffer s % buffer_count

    # -- buffers -----------------------------------------------------------------------------
    def records(self, tile: int) -> list[Record]:
        """``buffer_count`` record views for ``tile``-element tiles (the pool grows to the largest tile)."""
        if tile > self._pool_tile:
            self._pool = ops.aligned_pinned_empty(self.buffer_count * record_bytes(tile), dtype=torch.uint8).zero_()
            self._pool_tile = tile
        size = record_bytes(self._pool_tile)  # a multiple of 4096: every record stays aligned
        return [Record(self._pool[i * size:(i + 1) * size], tile) for i in range(self.buffer_count)]

    @property
    def pool_tile(self) -> int:
        """Elements of the largest tile a buffer holds."""
        return self._pool_tile

    @property
    def pool(self) -> torch.Tensor | None:
        """The pinned buffers (the host memory the swapped optimizer state occupies)."""
        return self._pool

    def path(self, group: int, kind: str = "group") -> str:
        return os.path.join(self.dir, f"{kind}{group}.swap")

    # -- transfers ---------------------------------------------------------------------------
    @property
    def lanes(self) -> int:
        return len(self.writers)

    def write(self, rec: Record, path: str, offset: int, step: int, lane: int = 0) -> None:
        try:
            self.writers[lane].async_pwrite(rec.raw, path, offset)
        except OSError as e:
            raise SwapError(self._say("write", path, offset, step, e)) from e

    def read(self, rec: Record, path: str, offset: int, step: int) -> None:
        try:
            size = os.path.getsize(path)
        except OSError as e:
            raise SwapError(self._say("read", path, offset, step, e)) from e
        if size < offset + rec.nbytes:  # a truncated file: refuse before reading a short record
            raise SwapError(f"zerocore nvme: {path} at byte offset {offset} (step {step}): the swap file is "
                            f"{size} bytes, the record needs {offset + rec.nbytes}: the file was truncated. Nothing "
                            "was changed")
        try:
            self.reader.async_pread(rec.raw, path, offset)
        except OSError as e:
            raise SwapError(self._say("read", path, offset, step, e)) from e

    def wait_writes(self, step: int, lane: int | None = None) -> None:
        """Every write issued so far on ``lane`` (None: on every lane) is complete (the engine checks
        that each wrote all its bytes)."""
        try:
            for w in self.writers if lane is None else [self.writers[lane]]:
                w.wait()
        except OSError as e:
            raise SwapError(self._say("write", self.dir, None, step, e)) from e

    def wait_reads(self, step: int) -> None:
        try:
            self.reader.wait()
        except OSError as e:
            raise SwapError(self._say("read", self.dir, None, step, e)) from e

    def take_ahead(self, path: str | None, commit: int | None) -> tuple[int, int]:
        """(tiles, first sequence number): how many first tiles of ``path`` at ``commit`` were already
        read into the buffers, from which sequence number on ((0, the running sequence): none; reads
        ahead for anything else are finished and forgotten, their buffers free again)."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[:2] == (path, commit):
            return ahead[2], ahead[3]
        if ahead is not None:
            try:
                self.reader.wait()
            except OSError:
                pass  # a read nobody will use
        return 0, self.seq

    def read_ahead(self, rec: Record, path: str, commit: int, offset: int, step: int, seq: int) -> None:
        """The first tile of the pass the worker runs next, read now into ``rec`` (buffer ``seq``);
        that pass takes it (``take_ahead``). A file that cannot be read is left for that pass to say."""
        try:
            self.read(rec, path, offset, step)
        except SwapError:
            return
        self.ahead = (path, commit, 1, seq)

    def drain(self) -> None:
        """Waits for everything in flight, errors dropped (after an error: the buffers are reused)."""
        self.ahead = None
        for h in (self.reader, *self.writers):
            try:
                h.wait()
            except OSError:
                pass

    def _say(self, op: str, path: str, offset, step: int, e: OSError) -> str:
        where = f"{path}" + (f" at byte offset {offset}" if offset is not None else "")
        hint = {errno.ENOSPC: "the disk is full", errno.EROFS: "the file system is read-only",
                errno.EACCES: "permission denied", errno.EDQUOT: "the disk quota is exceeded"}.get(e.errno, "")
        hint = f" ({hint})" if hint else ""
        return (f"zerocore nvme: {op} of {self.what} swap {where} failed at step {step}{hint}: {e}. The step "
                "was not applied")

    # -- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stops the I/O and removes this rank's swap folder."""
        self.drain()
        for h in (self.reader, *self.writers):
            h.close()
        self._finalizer()
