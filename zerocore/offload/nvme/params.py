"""Stage-3 parameter shards beyond ``offload_param.max_in_cpu`` on NVMe.

Each such group's owned 16-bit (or fp32) shard rests in ``params<g>.swap`` of the rank's swap
folder as one verified record (``ParamRecord``) in two slots: a write goes to the slot not
holding the current shard and the group's commit number advances only once it completed, so a
failed write or a bad read changes nothing. In host memory there are only
``offload_param.buffer_count`` pinned buffers (each the size of the largest swapped shard, at
most ``buffer_size`` elements). A group is *resident* while a buffer holds it; then
``group.param_shard`` is a view of that buffer, else an empty tensor (a stray read fails on the
shape instead of reading another group's bytes).

Who needs a shard, and for how long:
- a gather (training thread): ``on_gather`` (the group's ``GroupOffload.on_gather``) makes the group resident and
  *pins* it until its all-gather completed (its state leaves GATHERING); it also reads ahead the
  next groups of the order recorded since the last step into buffers nobody needs sooner;
- any other reader of ``owned_params()`` (through the group's ``GroupOffload.ready``, a ``ParamReady``): resident
  and pinned until the training thread's next request;
- the host step (``held``, usually on the worker thread): the buffer is held while the step
  writes the updated shard, then written back behind it (write-behind: the buffer is reused once
  that write completed). A step writes every element of the shard (the 16-bit values come from
  the fp32 master), so a shard not resident is not read for it.
Pins never hold more than ``buffer_count - 1`` buffers, so the worker always finds one and never
waits for the training thread (no deadlock); a gather beyond that reads from a transient copy.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading

import torch
import torch.distributed as dist

from ... import ops
from ..._weak import back_ref
from ...config.options import ConfigError
from ...sharding.state import ParamState
from .checks import check_free_space, free_bytes
from .records import ParamRecord, SwapCorruptError, SwapError, param_record_bytes
from .store import SwapStore

PAR_KEY = "zero_optimization.offload_param"
FREE, LOADING, READY, WRITING = "free", "loading", "ready", "writing"


@dataclasses.dataclass
class _Buffer:
    index: int
    group: int | None = None  # whose shard it holds (LOADING: is being read into it)
    state: str = FREE
    held: bool = False  # by a host step
    dirty: bool = False  # changed since it was read or written: written back before reuse
    used: int = 0  # when last asked for (least recently used goes first)
    write_commit: int = 0  # the commit number of the write in flight (WRITING)
    fence: object = None  # CUDA: the device copy of a gather read from it is done when this event is


class _Swapped:
    """One group whose parameter shard rests in a swap file. The group is reached weakly: the group
    holds this swap (through its readiness, ``ParamReady``), and the engine owns both."""

    group = back_ref()  # ShardedGroup

    def __init__(self, group, n: int, path: str):
        self.group, self.n, self.path = group, n, path
        self.commit = 0  # the current shard is in slot commit % 2 and carries this number
        self.buffer: int | None = None
        self.error: BaseException | None = None  # a failed read-ahead, raised when the group is asked for


class ParamSwap:
    def __init__(self, config):
        par = config.zero_optimization.offload_param
        self.path = par.nvme_path
        self.buffer_count = par.buffer_count
        self.buffer_size = par.buffer_size
        self.aio = {k: getattr(config.aio, k) for k in ("block_size", "queue_depth", "intra_op_parallelism",
                                                        "single_submit", "overlap_events")}
        self.store: SwapStore | None = None
        self.groups: dict[int, _Swapped] = {}
        self.buffers = [_Buffer(i) for i in range(self.buffer_count)]
        self._pool: torch.Tensor | None = None
        self._slot_bytes = 0
        self.cond = threading.Condition(threading.RLock())
        self.pins: set[int] = set()  # groups the training thread pinned
        self.copies: set[int] = set()  # groups whose param_shard is a transient copy (pins exhausted)
        self.train_thread = threading.get_ident()
        self.step = 0  # the last optimizer step seen (named in errors)
        self.tick = 0
        self.last: list[int] = []  # gathers of the last step, in order (drives the read-ahead)
        self.seq: list[int] = []  # gathers since the last step
        self.step_queue: list[int] = []  # swapped groups in the order the worker steps them
        self.free = free_bytes(self.path)
        self.needed = 0

    # -- construction ------------------------------------------------------------------------
    def register(self, g, also_needed: int = 0) -> None:
        """Group ``g``'s host shard (``g.param_shard``) goes to its swap file; the group keeps an
        empty tensor until it is asked for. ``also_needed``: swap bytes others put on the same drive."""
        n = g.hi - g.lo
        if self.buffer_count < 2:
            raise ConfigError(f"{PAR_KEY}.buffer_count: {self.buffer_count}; parameter shards on NVMe need at least "
                              "2 buffers (one for the host step, one for gathers)")
        if n > self.buffer_size:
            raise ConfigError(f"{PAR_KEY}.buffer_size: {self.buffer_size} elements is smaller than group {g.index}'s "
                              f"parameter shard ({n} elements on this rank); raise buffer_size to at least {n}")
        if self.store is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            self.store = SwapStore(self.path, rank, self.aio, self.buffer_count, what="parameter shard")
        dtype = g.param_shard.dtype
        self.needed += 2 * param_record_bytes(n, dtype)
        check_free_space(f"{PAR_KEY}.nvme_path", self.path, self.needed + also_needed, self.free,
                         f"parameter shards of this rank's groups beyond max_in_cpu, two slots each, through group "
                         f"{g.index}" + (" and the optimizer state on the same drive" if also_needed else ""))
        self._grow(param_record_bytes(n, dtype))
        sw = _Swapped(g, n, self.store.path(g.index, "params"))
        self.groups[g.index] = sw
        b = self.buffers[0]  # every buffer is free while groups are registered
        self._record(b, sw).values.copy_(g.param_shard)
        b.group, b.state, b.dirty = g.index, READY, True
        sw.buffer = 0
        sw.commit = -1  # the first write is commit 0
        self._evict(b)
        g.param_shard = self._empty(g)

    def _grow(self, nbytes: int) -> None:
        if nbytes > self._slot_bytes:
            self._pool = ops.aligned_pinned_empty(self.buffer_count * nbytes, dtype=torch.uint8).zero_()
            self._slot_bytes = nbytes

    @property
    def pool(self) -> torch.Tensor | None:
        """The pinned buffers: the host memory the swapped parameter shards occupy."""
        return self._pool

    @staticmethod
    def _empty(g) -> torch.Tensor:
        return torch.empty(0, dtype=g.layout.dtype)

    def _record(self, b: _Buffer, sw: _Swapped) -> ParamRecord:
        s = self._slot_bytes
        return ParamRecord(self._pool[b.index * s:(b.index + 1) * s], sw.n, sw.group.layout.dtype)

    def _offset(self, sw: _Swapped, commit: int) -> int:
        return (commit % 2) * param_record_bytes(sw.n, sw.group.layout.dtype)

    def _where(self, sw: _Swapped, commit: int) -> str:
        return f"{sw.path} at byte offset {self._offset(sw, commit)} (step {self.step})"

    # -- transfers (under self.cond) ---------------------------------------------------------
    def _lane(self, b: _Buffer) -> int:
        return b.index % self.store.lanes

    def _read(self, sw: _Swapped, b: _Buffer) -> None:
        self.store.read(self._record(b, sw), sw.path, self._offset(sw, sw.commit), self.step)
        b.group, b.state, b.dirty = sw.group.index, LOADING, False
        sw.buffer = b.index

    def _finish_reads(self) -> None:
        """Every read in flight has landed and was verified (a bad record: its group's error)."""
        loading = [b for b in self.buffers if b.state == LOADING]
        if not loading:
            return
        try:
            self.store.wait_reads(self.step)
        except SwapError as e:
            for b in loading:
                self.groups[b.group].error = e
                self._detach(b)
            return
        for b in loading:
            sw = self.groups[b.group]
            try:
                self._record(b, sw).verify(
                    {"run": self.store.run, "rank": self.store.rank, "group": b.group, "tile": 0,
                     "commit": sw.commit, "elements": sw.n}, self._where(sw, sw.commit))
            except SwapCorruptError as e:
                sw.error = e
                self._detach(b)
                continue
            b.state = READY

    def _write(self, sw: _Swapped, b: _Buffer) -> None:
        new = sw.commit + 1
        rec = self._record(b, sw)
        rec.seal(self.store.run, self.store.rank, sw.group.index, 0, new, sw.n)
        self.store.write(rec, sw.path, self._offset(sw, new), self.step, lane=self._lane(b))
        b.state, b.write_commit, b.dirty = WRITING, new, False

    def _finish_writes(self, lane: int | None = None) -> None:
        writing = [b for b in self.buffers if b.state == WRITING and (lane is None or self._lane(b) == lane)]
        try:
            self.store.wait_writes(self.step, lane)
        except SwapError:
            for b in writing:  # the shard in memory is the newest: written again before any reuse
                b.state, b.dirty = READY, True
            raise
        for b in writing:
            self.groups[b.group].commit = b.write_commit
            b.state = READY

    def _detach(self, b: _Buffer) -> None:
        if b.group is not None:
            sw = self.groups[b.group]
            sw.buffer = None
            if b.group not in self.copies:
                sw.group.param_shard = self._empty(sw.group)
        b.group, b.state, b.dirty = None, FREE, False

    @staticmethod
    def _fenced(b: _Buffer) -> None:
        """CUDA: the gather's non-blocking copy of this buffer to the device has run (before the
        buffer is read into again or a host step writes it)."""
        if b.fence is not None:
            b.fence.synchronize()
            b.fence = None

    def _evict(self, b: _Buffer) -> None:
        self._fenced(b)
        if b.state == LOADING:
            self._finish_reads()
        if b.state == READY and b.dirty:
            self._write(self.groups[b.group], b)
        if b.state == WRITING:
            self._finish_writes(self._lane(b))
        self._detach(b)

    # -- residency (under self.cond) ---------------------------------------------------------
    def _soon(self) -> set[int]:
        at = len(self.seq)
        return set(self.last[at:at + self.buffer_count]) | set(self.step_queue[:2])

    def _take(self, *, ahead: bool = False) -> _Buffer | None:
        """A buffer for another group: a free one, else the least recently used one nobody holds or
        pins (a read-ahead takes only free ones, or ones not needed soon and clean once their write
        behind completed)."""
        soon = self._soon()
        cands = [b for b in self.buffers if not b.held and b.group not in self.pins]
        if ahead:
            cands = [b for b in cands if b.state == FREE or (b.group not in soon and (
                b.state == WRITING or b.state == READY and not b.dirty))]  # (a write behind is finished first)
        if not cands:
            return None
        b = min(cands, key=lambda b: (b.state != FREE, b.group in soon, b.state != READY or b.dirty, b.used))
        self._evict(b)
        return b

    def _acquire(self, sw: _Swapped, *, read: bool = True, wait: bool = True) -> _Buffer:
        """Group ``sw`` resident (``read`` false: in a buffer, its old values not read: the caller
        writes every element; ``wait`` false: its read may still be in flight)."""
        while True:
            if sw.error is not None:
                e, sw.error = sw.error, None  # asked again later, the shard is read again
                raise e
            if sw.buffer is not None:
                b = self.buffers[sw.buffer]
                if b.state == LOADING and wait:
                    self._finish_reads()
                    continue
                break
            b = self._take()
            if b is None:  # the training thread, while the worker holds the one buffer not pinned
                self.cond.wait()
                continue
            if not read:
                b.group, b.state, b.dirty = sw.group.index, READY, False
                sw.buffer = b.index
                break
            self._read(sw, b)
            if wait:
                self._finish_reads()
        self.tick += 1
        b.used = self.tick
        if b.state != LOADING and sw.group.index not in self.copies:
            sw.group.param_shard = self._record(b, sw).values
        return b

    def _read_ahead(self, gis) -> None:
        for gi in gis:
            sw = self.groups.get(gi)
            if sw is None or sw.buffer is not None or sw.error is not None:
                continue
            b = self._take(ahead=True)
            if b is None:
                return
            try:
                self._read(sw, b)
            except SwapError as e:  # a truncated file: said when the group is asked for
                sw.error = e

    def _sweep(self) -> None:
        """Training thread: releases pins (and transient copies) of groups whose all-gather is done."""
        for gi in list(self.pins | self.copies):
            g = self.groups[gi].group
            if g.param_state.value is ParamState.GATHERING:
                continue
            if gi in self.pins:
                self.pins.discard(gi)
                sw = self.groups[gi]
                if sw.buffer is not None and g.param_flat.device.type == "cuda":  # its copy may be queued
                    b = self.buffers[sw.buffer]
                    b.fence = torch.cuda.Event()
                    b.fence.record(torch.cuda.current_stream(g.param_flat.device))
            if gi in self.copies:
                self.copies.discard(gi)
                sw = self.groups[gi]
                g.param_shard = self._record(self.buffers[sw.buffer], sw).values if sw.buffer is not None \
                    else self._empty(g)
        self.cond.notify_all()

    def _pin(self, sw: _Swapped, *, copy_if_full: bool, wait: bool = True) -> None:
        gi = sw.group.index
        if gi in self.pins:
            self._acquire(sw, wait=wait)
            return
        if len(self.pins) < self.buffer_count - 1:
            self.pins.add(gi)
            try:
                self._acquire(sw, wait=wait)
            except BaseException:
                self.pins.discard(gi)
                raise
        elif copy_if_full:  # every pinnable buffer feeds a gather in flight: this one reads a copy
            b = self._acquire(sw)
            sw.group.param_shard = self._record(b, sw).values.clone()
            self.copies.add(gi)

    # -- the hooks ---------------------------------------------------------------------------
    def on_gather(self, gi: int) -> None:
        """ShardedGroup.on_gather (training thread): group ``gi`` is about to be gathered."""
        with self.cond:
            self.seq.append(gi)
            self._sweep()
            sw = self.groups.get(gi)
            if sw is not None:
                # its read runs while earlier units compute (verified at ready.wait); the host step
                # may still be to run: no copy yet
                self._pin(sw, copy_if_full=False, wait=False)
            at = len(self.seq)
            self._read_ahead(self.last[at:at + self.buffer_count])

    def make_resident(self, gi: int) -> None:
        """``GroupOffload.ready.wait()`` (training thread, after the host step): the shard is readable in
        ``group.param_shard`` until the gather reading it completed (or the next request)."""
        with self.cond:
            self._sweep()
            self._pin(self.groups[gi], copy_if_full=True)

    @contextlib.contextmanager
    def held(self, gi: int, step: int, *, overwrite: bool = False):
        """The host step's view of group ``gi``'s shard; written back (behind) when the block ends
        normally, read again from the file if it raised (it may have written part of an update).
        ``overwrite``: the block writes every element, so a shard not resident is not read first."""
        sw = self.groups[gi]
        with self.cond:
            self.step = max(self.step, step)
            if threading.get_ident() == self.train_thread:
                self._sweep()
            b = self._acquire(sw, read=not overwrite)
            if b.state == WRITING:  # last step's write still reads the buffer this step writes
                self._finish_writes(self._lane(b))
            self._fenced(b)
            b.held = True
            if gi in self.step_queue:
                del self.step_queue[:self.step_queue.index(gi) + 1]
        ok = False
        try:
            yield self._record(b, sw).values
            ok = True
        finally:
            with self.cond:
                b.held = False
                try:
                    if ok:
                        b.dirty = True
                        self._write(sw, b)
                    elif gi not in self.pins:
                        self._detach(b)
                finally:
                    self.cond.notify_all()

    def mark_dirty(self, gi: int) -> None:
        """Group ``gi``'s resident shard was written by its owner (``zerocore.gathered``): written
        back before its buffer is reused."""
        with self.cond:
            sw = self.groups.get(gi)
            if sw is not None and sw.buffer is not None:
                b = self.buffers[sw.buffer]
                if b.state == WRITING:
                    self._finish_writes(self._lane(b))
                b.dirty = True

    def new_pass(self, step_order: list[int]) -> None:
        """The step was launched: the gathers so far are the next forward's order; the host steps
        run in ``step_order``."""
        with self.cond:
            self._sweep()  # every unit was freed before the step: no gather holds a pin or a copy
            if self.seq:
                self.last, self.seq = self.seq, []
            self.step_queue = [gi for gi in step_order if gi in self.groups]  # (kept resident if they are)

    def flush(self) -> None:
        """Every buffer nobody pins written back and freed (tests: the next use reads the file)."""
        with self.cond:
            self._sweep()
            for b in self.buffers:
                if not b.held and b.group not in self.pins:
                    self._evict(b)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


class ParamReady:
    """``GroupOffload.ready`` of a swapped group: the host step's Ready, then the shard made resident."""

    def __init__(self, host_ready, swap: ParamSwap, gi: int):
        self.host, self.swap, self.gi = host_ready, swap, gi

    def wait(self) -> None:
        self.host.wait()
        self.swap.make_resident(self.gi)
