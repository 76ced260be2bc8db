"""NvmeOptimizerShard: one group's owned optimizer state (fp32 master, m, v) in a swap file, with
the contract of the host-stepped shards (``land``, ``landed_sumsq``, ``step``, ``master``, ``load_master``,
``state_tiles``, ``refresh_params``, ``tensors``).

The host step goes tile by tile (``sub_group_size`` elements, rounded up to 1024): while tile k
is stepped in a pinned buffer, tile k+1 is read (``pipeline_read``) and tile k-1 written
(``pipeline_write``), through the store's ``buffer_count`` buffers, so host memory for the state
is the buffers whatever the model size. Across groups too: the pass over a group reads the first
tile of the group stepped next (``then``: the worker's order at stage 3, index order at stages
1/2) while its own last tile is stepped and written, so the disk always has a read in flight
while Adam runs. (A group's writes are still waited for at the end of its own pass: its
parameters go back to the model only once its state is committed.)

A step never changes anything until every tile was read back verified and written: each tile
has two slots in the file and updated records go to the slot not holding the current state;
the updated parameters wait in a staging buffer. Only when the last write completed does the
shard advance its commit number (which every record header must carry to be accepted) and copy
the staging buffer into the parameters. (fp32 parameters in host memory of their own take each
tile's values at once, and a failed step puts the tiles it wrote back from the current records:
the staging buffer would be one more fp32 copy of the parameters in RAM.) A corrupt record, a short file or a failed write raise
SwapError with the state and the parameters as they were before the step.

Gradient landing, the norm and the host step's hand-off are every host-stepped shard's
(``HostSteppedShard``, shared with ``HostOptimizerShard``): only where the state rests differs,
so the results are the CPU-offload run's bit for bit.
"""
from __future__ import annotations

import dataclasses

import torch

from ...sharding.group import ShardedGroup
from ...sharding.optimizer import AdamHyper, step_plan
from ..host_memory import host_empty
from ..host_shard import _adam
from ..host_stepped import HostSteppedShard
from .records import SwapError, padded, record_bytes
from .store import SwapStore


@dataclasses.dataclass
class SwapOptions:
    tile: int  # elements per tile (sub_group_size)
    fast_init: bool = False
    pipeline_read: bool = False
    pipeline_write: bool = False


class NvmeOptimizerShard(HostSteppedShard):
    """All of the owned range's state in the swap file, stepped on the host tile by tile."""

    reads_ahead = True  # see OptimizerShard's protocol
    tiles_kept = False  # state_tiles streams every tile through the same pinned buffer

    def __init__(self, group: ShardedGroup, init_fp32: torch.Tensor, *, store: SwapStore, opts: SwapOptions,
                 pin: bool):
        n = group.hi - group.lo
        super().__init__(group, split=n, pin=pin)  # all of the owned range is swapped (no device part)
        self.n = n
        self.tile = max(1, min(n, padded(opts.tile)))  # 1024-multiples: kernel vectors never split differently
        self.tiles = [(lo, min(n, lo + self.tile)) for lo in range(0, n, self.tile)]
        self.opts = opts
        self.store = store
        self.path = store.path(group.index)
        self.rec_bytes = record_bytes(self.tile)
        self.commit = 0  # records of the current state carry this number, in slot commit % 2
        self.last_step = 0
        self.staging = None  # updated parameters until the step commits (made at the first step that needs one)
        self.then: NvmeOptimizerShard | None = None  # the shard the worker steps next (OffloadPlan.launch)
        owned = init_fp32 if init_fp32.numel() == n else init_fp32[group.lo:group.hi]
        self._swap_out(owned.detach().to("cpu", torch.float32))

    @staticmethod
    def size_on_disk(n: int, tile: int) -> int:
        """Bytes of the swap file of an ``n``-element owned range: two slots of every tile's record."""
        t = max(1, min(n, padded(tile)))
        return 2 * (-(-n // t)) * record_bytes(t)

    # -- records -----------------------------------------------------------------------------
    def _offset(self, k: int, commit: int) -> int:
        return (2 * k + commit % 2) * self.rec_bytes

    def _seal_and_write(self, rec, k: int, commit: int, step: int, lane: int | None = None) -> None:
        lo, hi = self.tiles[k]
        rec.seal(self.store.run, self.store.rank, self.group.index, k, commit, hi - lo)
        lane = k % self.store.lanes if lane is None else lane
        self.store.write(rec, self.path, self._offset(k, commit), step, lane=lane)

    def _swap_out(self, master: torch.Tensor) -> None:
        """The initial state (master, zero moments) to slot 0; with ``fast_init`` in batches of
        ``buffer_count`` records in flight at once, else one record at a time."""
        recs = self.store.records(self.tile)
        batch = len(recs) if self.opts.fast_init else 1
        for k, (lo, hi) in enumerate(self.tiles):
            rec = recs[k % batch]
            m, a, v = rec.arrays(hi - lo)
            m.copy_(master[lo:hi])
            a.zero_()
            v.zero_()
            self._seal_and_write(rec, k, 0, 0)
            if (k + 1) % batch == 0:
                self.store.wait_writes(0)
        self.store.wait_writes(0)

    def _tiles_io(self, step: int, write: bool, then: "NvmeOptimizerShard | None" = None):
        """Yields (lo, hi, record) for every tile, read back and verified; with ``write`` each record
        (as the consumer left it) is written to the other slot and the shard commits at the end. An
        error or an early close leaves the current state as it was.

        Tiles pass through the store's buffers in the store's running sequence (tile k of this pass
        is sequence ``seq0 + k``: buffer ``seq % buffer_count``, write lane ``seq % lanes``), so a pass
        continues where the last one left the buffers. ``then``: the shard the worker steps next;
        its first tile is read while this pass's last tile is stepped and written (the next pass
        finds it with ``take_ahead``), so the disk is not idle between groups."""
        store, nbuf = self.store, self.store.buffer_count
        ahead = self.opts.pipeline_read and nbuf >= 2
        cur, new = self.commit, self.commit + 1
        writing: set[int] = set()  # sequence numbers whose write is in flight (their buffers are busy)
        issued, seq0 = store.take_ahead(self.path, cur)  # first tiles read earlier (read_first_tiles, a last pass)
        recs = store.records(self.tile)
        n_tiles = len(self.tiles)

        def free(s):  # buffer s % nbuf may be read into: wait for the write of the record it still holds
            if s - nbuf in writing:  # its lane only: the newer writes are on the other lanes
                lane = (s - nbuf) % store.lanes
                store.wait_writes(step, lane)
                writing.difference_update({j for j in writing if j % store.lanes == lane})

        def read(k):
            if k < issued:
                return
            free(seq0 + k)
            store.read(recs[(seq0 + k) % nbuf], self.path, self._offset(k, cur), step)

        def read_next():  # the next group's first tile, into the buffer after this pass's last
            if not (write and ahead and then is not None and then.tile <= store.pool_tile and then is not self):
                return
            free(seq0 + n_tiles)
            rec = store.records(then.tile)[(seq0 + n_tiles) % nbuf]
            store.read_ahead(rec, then.path, then.commit, then._offset(0, then.commit), step, seq0 + n_tiles)

        expect = {"run": store.run, "rank": store.rank, "group": self.group.index, "commit": cur,
                  "payload bytes": self.rec_bytes - 4096}
        try:
            read(0)
            for k, (lo, hi) in enumerate(self.tiles):
                s = seq0 + k
                store.wait_reads(step)
                rec = recs[s % nbuf]
                rec.verify(dict(expect, tile=k, elements=hi - lo),
                           f"{self.path} at byte offset {self._offset(k, cur)} (step {step})")
                if ahead and k + 1 < n_tiles:
                    read(k + 1)
                elif k + 1 == n_tiles:
                    read_next()
                yield lo, hi, rec
                if write:
                    self._seal_and_write(rec, k, new, step, lane=s % store.lanes)
                    writing.add(s)
                    if not self.opts.pipeline_write:
                        store.wait_writes(step)
                        writing.clear()
                if not ahead and k + 1 < n_tiles:
                    read(k + 1)
            store.wait_writes(step)
        except BaseException:
            store.drain()  # nothing may still be moving into or out of the buffers
            raise
        store.seq = max(store.seq, seq0 + n_tiles)
        if write:
            self.commit = new

    def read_first_tiles(self, step: int) -> None:
        """Stages 1/2, when this group (the first the step reads) has landed in the boundary backward:
        its first tiles are read while backward goes on (the step would start with waiting for them)."""
        nbuf = self.store.buffer_count
        n = min(nbuf, len(self.tiles)) if self.opts.pipeline_read and nbuf >= 2 else 1
        self.store.take_ahead(None, None)  # whatever an earlier read-ahead left is dropped
        recs, seq0 = self.store.records(self.tile), self.store.seq
        try:
            for k in range(n):
                self.store.read(recs[(seq0 + k) % nbuf], self.path, self._offset(k, self.commit), step)
        except SwapError:  # (a truncated file) said by the step itself, which reads it again
            self.store.drain()
            return
        self.store.ahead = (self.path, self.commit, n, seq0)

    # -- the step --------------------------------------------------------------------------
    def step(self, grad: torch.Tensor, hp: AdamHyper, *, step: int, grad_scale: float):
        plan = step_plan(self.pieces, self.group.hi - self.group.lo, hp)

        def host_part():
            self.wait_copy_back()  # last step's copy back still reads the staging buffer
            if self._direct():
                return self._step_direct(plan, step, grad_scale)
            if self.staging is None:
                self.staging = host_empty(self.n, self.group.layout.dtype, self.pin)
            for lo, hi, rec in self._tiles_io(step, write=True, then=self.then):
                m, a, v = rec.arrays(hi - lo)
                out = self.staging[lo:hi]
                _adam(m, self.grad_h[lo:hi], a, v, out if self.half else None, plan, step, grad_scale, hi - lo,
                      base=lo)
                if not self.half:
                    out.copy_(m)
            self.last_step = step
            with self._params(step) as target:
                return self._copy_back(target, self.staging)  # the step commits: its parameters go in

        return self._run_host(host_part)

    def _direct(self) -> bool:
        """fp32 parameters in host memory of their own (a CPU device, no parameter swap): each tile's
        new master goes straight into them, no staging buffer (4 bytes a parameter less); a step
        that fails puts the tiles it wrote back from the current state's records (``_undo``)."""
        return not self.half and self.param_swap is None and self.group.owned_params_raw().device.type == "cpu"

    def _step_direct(self, plan, step: int, grad_scale: float) -> None:
        target = self.group.owned_params_raw()
        done = 0  # parameters [0, done) hold this step's values
        try:
            for lo, hi, rec in self._tiles_io(step, write=True, then=self.then):
                m, a, v = rec.arrays(hi - lo)
                _adam(m, self.grad_h[lo:hi], a, v, None, plan, step, grad_scale, hi - lo, base=lo)
                target[lo:hi].copy_(m[:hi - lo])
                done = hi
        except BaseException as e:
            if done:
                self._undo(target, done, step, e)
            raise
        self.last_step = step
        return None

    def _undo(self, target: torch.Tensor, done: int, step: int, error: BaseException) -> None:
        """After a failed step: parameters [0, ``done``) back to the current (not advanced) state."""
        try:
            for lo, hi, rec in self._tiles_io(self.last_step, write=False):
                if lo >= done:
                    break
                target[lo:min(hi, done)].copy_(rec.master[:min(hi, done) - lo])
        except SwapError as again:
            raise SwapError(f"{error}; putting the parameters back from the swap file failed too ({again}): "
                            f"parameters [0, {done}) of group {self.group.index} hold step {step}'s values, the "
                            "optimizer state the previous step's") from error

    # -- what the engine and checkpoints read ------------------------------------------------
    @property
    def master(self) -> torch.Tensor:
        """A host copy of the owned fp32 master, assembled tile by tile."""
        self.ready.wait()
        out = torch.empty(self.n, dtype=torch.float32)
        for lo, hi, rec in self._tiles_io(self.last_step, write=False):
            out[lo:hi] = rec.master[:hi - lo]
        return out

    def load_master(self, a: int, b: int, values: torch.Tensor) -> None:
        self.ready.wait()
        if self.param_swap is not None:  # zerocore.gathered wrote the resident shard first
            self.param_swap.mark_dirty(self.group.index)
        for lo, hi, rec in self._tiles_io(self.last_step, write=True):
            x, y = max(a, lo), min(b, hi)
            if x < y:
                rec.master[x - lo:y - lo].copy_(values[x - a:y - a])

    def state_tiles(self, max_elems: int, *, write: bool = False):
        """(lo, hi, {"master", "exp_avg", "exp_avg_sq"}) streamed tile by tile (at most ``max_elems``
        each): views of the pinned buffer; with ``write`` what the caller puts into them is written
        back and committed once the last tile was consumed."""
        self.ready.wait()
        chunk = max(1, max_elems)
        for lo, hi, rec in self._tiles_io(self.last_step, write=write):
            m, a, v = rec.arrays(hi - lo)
            for x in range(0, hi - lo, chunk):
                y = min(hi - lo, x + chunk)
                yield lo + x, lo + y, {"master": m[x:y], "exp_avg": a[x:y], "exp_avg_sq": v[x:y]}

    def refresh_params(self) -> None:
        self.ready.wait()
        with self._params(self.last_step) as target:
            for lo, hi, rec in self._tiles_io(self.last_step, write=False):
                target[lo:hi].copy_(rec.master[:hi - lo])

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"host_grads": self.grad_h, "host_staging": self.staging, "host_swap": self.store.pool,
                "host_params": None if self.param_swap is None else self.param_swap.pool}
